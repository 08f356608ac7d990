"""Sampled requests speculate: the engine's n-gram drafts, verified in the step by the rejection
rule (model/rejection_sampler.verify_slots), leave each request's output law exactly the
target's. The rule itself is proven statistically in test_rejection_sampler.py; this is the
engine's wiring (slots, keys, the correction and the bonus, kept drafts' KV), tested the same
way: the law of the first three tokens of thousands of seeded requests against the exact joint
law of the dense model, and the same test failing when the rule is broken."""

import jax
import numpy as np
import pytest
from conftest import dense_forward, drain, make_engine
from scipy import stats
from test_rejection_sampler import mutated

from jaxserve.model import rejection_sampler as rs
from jaxserve.model.sampler import host_sampling_arrays
from jaxserve.types import SamplingParams

ALPHA = 1e-3  # the chi-square test's significance
N = 6000  # requests, each with its own seed
TOP_K = 3  # the law of three tokens has at most 27 cells, so N fills each
TEMPERATURE = 8.0  # the tiny random model is peaked (p = 0.99 at 1.5): this spreads its top 3
SETTINGS = dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0, min_p=0.0)


def _prompt(model):
    """A prompt whose n-gram drafts the model often accepts: a random start and the model's own
    greedy continuation of it, which falls into a loop (greedy small models do), so the lookup
    drafts the loop's next tokens, which are the model's likeliest ones."""
    fwd = dense_forward(model)
    prompt = np.random.default_rng(7).integers(3, 256, size=6).tolist()
    for _ in range(30):
        prompt.append(int(np.argmax(fwd([prompt])[0, len(prompt) - 1])))
    return prompt


def _exact_law(model, prompt):
    """P(t1, t2, t3) [V, V, V] under the sampler's law (rs.sampling_probs, itself checked against
    a float64 sort in test_rejection_sampler.py) on the dense model's logits."""
    fwd = dense_forward(model)
    probs = jax.jit(rs.sampling_probs)
    s1 = host_sampling_arrays([dict(**SETTINGS, seed=0, step=0)])
    p1 = np.asarray(probs(fwd([prompt])[:, len(prompt) - 1], s1))[0]
    V = p1.shape[0]
    law = np.zeros((V, V, V))
    for a in np.flatnonzero(p1):
        la = fwd([prompt + [int(a)]])[:, len(prompt)]
        p2 = np.asarray(probs(la, s1))[0]
        bs = np.flatnonzero(p2)
        lb = fwd([prompt + [int(a), int(b)] for b in bs])[:, len(prompt) + 1]
        sb = host_sampling_arrays([dict(**SETTINGS, seed=0, step=0)] * len(bs))
        p3 = np.asarray(probs(lb, sb))
        for j, b in enumerate(bs):
            law[a, b] = p1[a] * p2[b] * p3[j]
    return law


# The ways drafts are made: n-gram lookup (q one-hot), the target's own first layer as a draft
# model, and a draft model of its own, the target with noise on every weight (engine/self_draft.py:
# q is the draft's full distribution).
METHODS = {"ngram": {}, "self-draft": {"speculative_layers": 1}, "draft-model": {}}


def noisy_copy(model, scale=0.5, seed=11):
    """The model with Gaussian noise of `scale` times each weight's own spread added: a draft
    that agrees with the target often, not always."""
    from jaxserve.model.llama import Llama, flat_params
    rng = np.random.default_rng(seed)
    arrays = {k: (np.asarray(v) + scale * np.asarray(v).std() * rng.standard_normal(np.shape(v))).astype(np.float32)
              for k, v in flat_params(model).items()}
    return Llama.from_arrays(model.cfg, arrays, dtype=model.dtype)


def _sample(model, tok, prompt, n, method="ngram"):
    draft = noisy_copy(model) if method == "draft-model" else None
    # One bucket, the step's whole budget: half the step programs to compile (each engine here
    # compiles its own: another draft method, or a mutated rule). A step's bucket is only its
    # padding: the schedule and each request's seeded draws do not depend on it (the outputs of
    # seeded n-gram requests are identical with buckets (64, 512) and (512,)).
    eng = make_engine(model, tok, max_model_len=64, num_pages=300, max_num_seqs=64,
                      max_num_batched_tokens=512, token_buckets=(512,), num_speculative_tokens=2,
                      adaptive_speculation=False, draft_model=draft, **METHODS[method])
    for i in range(n):
        eng.add_request({"prompt_token_ids": prompt},
                        SamplingParams(**SETTINGS, max_tokens=3, ignore_eos=True, seed=i), request_id=str(i))
    drain(eng)
    out = np.array([eng.pop_finished(str(i)).outputs[0].token_ids for i in range(n)])
    return out, dict(eng.stats)


def _chi_square(samples, law):
    V = law.shape[0]
    counts = np.bincount(samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2], minlength=V ** 3)
    p = law.reshape(-1)
    exp = p * len(samples)
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big & (p > 0)).any():  # cells expected below 5 pooled
        obs_b.append(counts[~big & (p > 0)].sum())
        exp_b.append(exp[~big & (p > 0)].sum())
    exp_b = np.array(exp_b) * (np.sum(obs_b) / np.sum(exp_b))
    return float(stats.chisquare(obs_b, exp_b).pvalue), int(counts[p == 0].sum())


@pytest.fixture(scope="module")
def case(tiny_model):
    model, tok = tiny_model
    prompt = _prompt(model)
    return model, tok, prompt, _exact_law(model, prompt)


@pytest.mark.parametrize("method", METHODS)
def test_sampled_requests_with_drafts_have_the_target_law(case, method):
    model, tok, prompt, law = case
    samples, st = _sample(model, tok, prompt, N, method)
    # Drafts ran and were both kept and refused, so both the bonus and the correction were drawn.
    assert st["draft_tokens"] > N // 2, st
    assert 0.1 * st["draft_tokens"] < st["accepted_draft_tokens"] < 0.9 * st["draft_tokens"], st
    pvalue, impossible = _chi_square(samples, law)
    assert impossible == 0, f"{impossible} outputs the target's law gives probability 0"
    assert pvalue >= ALPHA, f"chi-square p = {pvalue:.2e}: the engine's speculative outputs are not the target's law"


@pytest.mark.parametrize("mutant", [("_accept", lambda u, px, qx: qx > 0),  # keep every draft
                                    ("_residual", lambda p, q: p)],  # correct from p, not max(0, p - q)
                         ids=["accept-always", "resample-from-p"])
# q one-hot and q dense (self-draft's q is dense too, and its verify the same code: not repeated)
@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_the_same_test_fails_when_the_rule_is_broken(case, mutant, method):
    model, tok, prompt, law = case
    with mutated(*mutant):  # the step is compiled again with the broken rule
        samples, _ = _sample(model, tok, prompt, N // 2, method)
    pvalue, impossible = _chi_square(samples, law)
    assert impossible > 0 or pvalue < ALPHA, f"a broken rule passed: p = {pvalue:.3f}"
