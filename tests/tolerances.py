"""Tolerances derived from the operation (team rule: no guessed atol), shared by the tests.

Two fp32 evaluations of the same math that differ only in summation order (another kernel,
another tiling or vector width, a cached prefix instead of a full pass, AVX2 against AVX-512)
agree to within the reordering bound of their longest reduction: a sum of n terms computed in
any order is within gamma_n ~ n * eps of the magnitude of its terms (Higham, Accuracy and
Stability of Numerical Algorithms, section 3.1).
"""

from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def fp32_reorder_atol(reduction_len: int, reference) -> float:
    """The absolute tolerance for comparing against `reference` when only summation order may
    differ; `reduction_len` is the longest reduction on the path (the hidden size for logits),
    and `reference`'s largest magnitude stands for the magnitude of the summed terms."""
    return reduction_len * EPS32 * float(np.abs(np.asarray(reference, np.float64)).max())


def reduction_chain_len(cfg, seq_len: int) -> int:
    """The summed length of the reductions one logit passes through in a decoder forward pass.

    Per layer, in order along the path: the attention RMSNorm's mean of squares (hidden), the
    q/k/v projections (hidden), the q.k scores (head_dim), the softmax's sum and its weights
    times V (seq_len terms, counted once: the two sums' errors are of the same size), the o
    projection (num_heads * head_dim), the MLP RMSNorm (hidden), gate/up (hidden), down
    (intermediate); then the final norm and the LM head (hidden each). A relative error made
    in one op reaches the logits scaled by that op's sensitivity; RMSNorm divides the scale
    back out and softmax/SiLU have slopes <= 1, so to first order the per-op errors add, and
    the chain's error is that of one sum of this many terms (the tests' models are random or
    trained weights, with no op amplifying by much more than 1)."""
    h = cfg.hidden_size
    per_layer = h + h + cfg.head_dim + seq_len + cfg.num_heads * cfg.head_dim + h + h + cfg.intermediate_size
    return cfg.num_layers * per_layer + 2 * h


def fp32_logits_atol(cfg, seq_len: int, logits) -> float:
    """The absolute tolerance between two fp32 forward passes of one model (`cfg`) over
    `seq_len` tokens that differ only in summation order: another kernel or tiling, sharded
    matmuls adding partial sums, paged against dense attention, or HF/torch (oneDNN) against
    XLA on another CPU family (AVX2 against AVX-512 changes the vector width, i.e. only the
    order of the same sums).

    The chain of reductions behind one logit is n = reduction_chain_len(cfg, seq_len) terms
    long. The worst-case bound n * eps * |terms| (fp32_reorder_atol) is reached only if every
    rounding error has the same sign; rounding errors of round-to-nearest are as often up as
    down, so a sum's error grows like sqrt(n) * eps * |terms| (Higham, section 2.8's rule of
    thumb, and the probabilistic bounds of Higham & Mary 2019), whatever the order; that is
    the bound here, with the largest |logit| standing for the magnitude of the terms.
    Measured against HF goldens made on another machine (tests/test_goldens.py), the error is
    2-15 eps * max|logit| against sqrt(n) = 33 (tiny models) to 370 (SmolLM2, 30 layers), so
    this bound keeps 5x (tiny models) to 25x-75x (SmolLM2) headroom, while the worst-case n
    one (0.6 for SmolLM2) would be far above SmolLM2's smallest greedy margin (0.003)."""
    n = reduction_chain_len(cfg, seq_len)
    return float(np.sqrt(n)) * EPS32 * float(np.abs(np.asarray(logits, np.float64)).max())


def fp32_logprobs_atol(cfg, seq_len: int, logits) -> float:
    """fp32_logits_atol for log-softmax outputs. logprob = logit - logsumexp(logits): the
    logsumexp is a softmax-weighted mean of the logits' shifts, so it moves by at most the
    largest logit error, and its own sum over the vocabulary adds sqrt(vocab) * eps relative
    to the sum, i.e. that much absolute in the log: 2 * logits_atol + sqrt(vocab) * eps."""
    return 2 * fp32_logits_atol(cfg, seq_len, logits) + float(np.sqrt(cfg.vocab_size)) * EPS32


BF16_U = 2.0 ** -8  # bf16 keeps 8 significant bits: round-to-nearest is off by <= 2^-8 relative
# Per decoder layer, the values a bf16 model rounds to bf16 on one logit's path: 13 activations
# (attention norm output, q, k, v, attention output, o output, residual sum, MLP norm output,
# gate, up, act * up, down output, residual sum) and 7 weight matrices (q, k, v, o, gate, up,
# down; a matmul over weights each off by u relative, with random signs, is off by ~u relative).
BF16_ROUNDINGS_PER_LAYER = 20


def bf16_logits_atol(cfg, logits_fp32) -> float:
    """The absolute tolerance between a bf16 model's logits and the same weights' fp32 logits.

    Each rounding on the path makes a relative error <= u = 2^-8 in one value; norms divide the
    scale back out and the other ops have slopes ~1, so each reaches the logits as ~u of their
    size. They are independent, as often up as down, so m of them add like a random walk:
    sqrt(m) * u * max|logit|, with m = BF16_ROUNDINGS_PER_LAYER per layer plus the embedding,
    the final norm and the LM head (3). Measured on tests/test_model_layers.py's tiny Llama
    (seeds 4-7): 1.1-1.5 u * max|logit| against sqrt(43) = 6.6."""
    m = cfg.num_layers * BF16_ROUNDINGS_PER_LAYER + 3
    return float(np.sqrt(m)) * BF16_U * float(np.abs(np.asarray(logits_fp32, np.float64)).max())


def int8_kv_attention_atol(q, k, v, k_dequant, v_dequant, scales_k, scales_v, sm_scale: float) -> float:
    """A rigorous bound on |attention over int8-stored K/V - attention over the exact K/V|.

    q [..., H] queries; k, v [..., H] the exact keys/values; k_dequant, v_dequant what the
    int8 pages give back; scales_* their per-row scales (absmax / 127). Per element the
    quantization error is at most half a step, scale / 2 (asserted here, so a bound on real
    data). Attention is o = sum_j p_j v_j with p = softmax(sm_scale * q.k_j):
      - the values' errors: |sum_j p_j dv_j| <= max|dv| since the p_j sum to 1;
      - the keys' errors shift each score by at most d = max |sm_scale * q . dk_j| (over every
        query and key row: a superset of the pairs that attend), so p'_j = p_j e^(x_j) / Z with
        every x_j in [-d, d]. The total variation between p' and p is then at most tanh(d / 2)
        (the extreme case puts x = +d on part of the mass and -d on the rest; maximizing over
        that part gives tanh(d / 2)), and since sum(p' - p) = 0,
        |sum_j (p'_j - p_j) v_j| <= TV(p', p) * (max v - min v).
    The sum of the two terms bounds every output element. Being a worst case over every
    pattern of score errors, it sits ~7x above the error of the N(0, 1) case in
    tests/test_kv_int8.py, whose errors partly cancel."""
    H = q.shape[-1]
    q, k, v = (np.asarray(a, np.float64).reshape(-1, H) for a in (q, k, v))
    dk = np.asarray(k_dequant, np.float64).reshape(-1, H) - k
    dv = np.asarray(v_dequant, np.float64).reshape(-1, H) - v
    # Half a step per element (+ the bf16-stored scale's rounding: absmax can exceed 127 * scale
    # by u relative, clipped there, which is < half a step too).
    for d, s in ((dk, scales_k), (dv, scales_v)):
        assert (np.abs(d) <= np.asarray(s, np.float64).reshape(-1, 1) / 2 * (1 + BF16_U) + 1e-30).all()
    d = float(np.abs(sm_scale * q @ dk.T).max())
    return float(np.abs(dv).max()) + float(np.tanh(d / 2)) * float(v.max() - v.min())
