"""The pieces of scripts/make_goldens.py (run by hand with torch, never by the suite): `common`
(the seeded weights, HF greedy / top-5 goldens shared by every tiny checkpoint), one module per
family with its tiny checkpoints' specs (`TINY`), and the real models' goldens (`smollm2`,
`gemma3_270m`)."""
