"""Prefill/decode disaggregation across processes: the handover's wire format (wire.py) and the
KV pages' transport (kv_transfer.py). The engine's half is engine/handover.py."""
