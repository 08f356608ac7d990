"""The rejection sampler for speculative decoding (jaxserve/model/rejection_sampler.py).

Exactness is checked statistically: a tiny "bigram" target and a deliberately different bigram
draft, the whole speculative process simulated (the draft drafts from q given its own previous
tokens, the target verifies, rounds repeat until three tokens are out), and the law of the first
three emitted tokens compared with the target's exact joint law by a chi-square test. Two broken
rules must fail the same test, so it can fail. Fixed seeds: the outcome is deterministic.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.model import rejection_sampler as rs
from jaxserve.model.sampler import SamplingArrays, host_sampling_arrays
from jaxserve.scheduler.speculation import accept as greedy_accept

ALPHA = 1e-3  # significance of every chi-square test here
V = 6  # vocabulary of the bigram models
L = 3  # emitted tokens whose joint law is tested
N = 30_000  # simulated requests (rows), each with its own seed
C0 = 0  # the token every request's context ends with


def _bigrams():
    rng = np.random.default_rng(30)
    target = rng.standard_normal((V, V)).astype(np.float32) * 1.5
    # The draft is a different model: correlated with the target, but often wrong.
    draft = (0.5 * target + rng.standard_normal((V, V)) * 1.2).astype(np.float32)
    return target, draft


TARGET, DRAFT = _bigrams()


def settings(n, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=1000, step=0):
    return host_sampling_arrays([dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                      seed=seed + i, step=step) for i in range(n)])


def reference_probs(logits, temperature, top_k, top_p, min_p):
    """The sampler's distribution by its sorted definition, in float64 (no ties in these logits)."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    srt = logits[order].astype(np.float64) / temperature
    keep = np.arange(len(srt)) < (top_k if top_k > 0 else len(srt))
    pr = np.exp(np.where(keep, srt, -np.inf) - srt.max())
    pr /= pr.sum()
    if top_p < 1.0:
        keep &= (np.cumsum(pr) - pr) < top_p
    keep &= pr >= min_p * pr[0]
    pr = np.where(keep, pr, 0.0)
    out = np.zeros_like(pr)
    out[order] = pr / pr.sum()
    return out


def exact_joint(cfg):
    """P(t1, t2, t3) = p(t1 | C0) p(t2 | t1) p(t3 | t2), flattened t1 * V^2 + t2 * V + t3."""
    p = np.stack([reference_probs(TARGET[r], **cfg) for r in range(V)])
    return (p[C0][:, None, None] * p[:, :, None] * p[None, :, :]).reshape(-1)


K = 3  # drafts per round in the simulation (rows draft K, K - 1, 1 or 0: all counts on the path)


def make_round():
    """One speculative round for every row, jitted afresh (a mutant is traced anew; the settings
    are arrays, so one compile serves PLAIN and FILTERED): the draft drafts K tokens
    autoregressively from q, its bigram's conditionals through `sampling_probs` (one call for all
    V contexts) and `sample_draft`; the target scores the drafted run; `rejection_sample` verifies."""
    def run(last, num_drafts, s):
        q_of = rs.sampling_probs(jnp.broadcast_to(jnp.asarray(DRAFT), (last.shape[0], V, V)), s)
        rows = jnp.arange(last.shape[0])

        def draft_one(prev, i):  # a scan, so sample_draft is traced (and compiled) once
            q = q_of[rows, prev]
            x = rs.sample_draft(q, s, i)
            return x, (q, x)
        _, (qs, xs) = jax.lax.scan(draft_one, last, jnp.arange(K))
        qs, drafts = jnp.moveaxis(qs, 0, 1), xs.T
        target_logits = jnp.asarray(TARGET)[jnp.concatenate([last[:, None], drafts], axis=1)]
        # Padding past num_drafts holds token 0: were it read, 0 would come out too often.
        drafts = jnp.where(jnp.arange(K) < num_drafts[:, None], drafts, 0)
        return rs.rejection_sample(target_logits, qs, drafts, num_drafts, s)
    return jax.jit(run)


def simulate(run, cfg, seed=1000):
    """The first L tokens of N requests, each run as speculative rounds until L are out: a round
    starts at step = tokens so far (+ 7) and conditions on the last token."""
    out = np.full((N, L), -1, np.int64)
    count = np.zeros(N, np.int64)
    num_drafts = np.array([K, K, K - 1, 1, 0], np.int32)[np.arange(N) % 5]
    rows = np.arange(N)
    rounds = 0
    while (count < L).any():
        last = np.where(count > 0, out[rows, np.maximum(count - 1, 0)], C0).astype(np.int32)
        s = settings(N, seed=seed, **cfg)._replace(step=count.astype(np.int32) + 7)
        tokens, n = (np.asarray(a) for a in run(jnp.asarray(last), jnp.asarray(num_drafts), s))
        assert ((n >= 0) & (n <= num_drafts)).all()
        j = np.arange(K + 1)[None]
        assert (tokens[j <= n[:, None]] >= 0).all() and (tokens[j > n[:, None]] == -1).all()
        for j in range(K + 1):
            take = (j <= n) & (count < L)
            out[rows[take], count[take]] = tokens[take, j]
            count += take
        rounds += 1
    assert rounds > 1  # rejections happened, so later rounds (steps) are on the path
    return out


def chi_square(samples, probs):
    """Pearson's test of the samples' cell counts against probs, cells expected below 5 pooled:
    (statistic, p-value, degrees of freedom, samples in cells of probability 0). The law is
    accepted iff no sample is in a zero cell and p-value >= ALPHA (`fits`)."""
    cells = samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2]
    counts = np.bincount(cells, minlength=V ** L)
    exp = probs * len(samples)
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big & (probs > 0)).any():
        obs_b.append(counts[~big & (probs > 0)].sum())
        exp_b.append(exp[~big & (probs > 0)].sum())
    # chisquare wants equal totals: the zero cells' samples are left out here and counted apart
    exp_b = np.array(exp_b) * (np.sum(obs_b) / np.sum(exp_b))
    res = stats.chisquare(obs_b, exp_b)
    return float(res.statistic), float(res.pvalue), len(obs_b) - 1, int(counts[probs == 0].sum())


def fits(result):
    return result[3] == 0 and result[1] >= ALPHA


PLAIN = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
FILTERED = dict(temperature=0.7, top_k=4, top_p=0.9, min_p=0.0)  # cuts 2 to 4 of the 6 tokens, per context
SETTINGS = dict(PLAIN=PLAIN, FILTERED=FILTERED)


_probs = jax.jit(rs.sampling_probs)  # always called on [3, V, V]: one compile


def test_reference_matches_sampling_probs():
    # The test's float64 reference is the sampler's law: sampling_probs (the module's p and q) on
    # [B, P, V], row b's settings at each of its P positions: row 0 PLAIN, row 1 FILTERED (whose
    # filters do cut: zeros), row 2 greedy (the argmax one-hot).
    s = SamplingArrays(*(np.concatenate(x) for x in zip(settings(1, **PLAIN), settings(1, **FILTERED),
                                                          settings(1, temperature=0.0))))
    got = np.asarray(_probs(jnp.asarray(np.stack([TARGET] * 3)), s))
    for r, cfg in enumerate((PLAIN, FILTERED)):
        want = np.stack([reference_probs(TARGET[c], **cfg) for c in range(V)])
        np.testing.assert_allclose(got[r], want, atol=2e-6)
        np.testing.assert_array_equal(got[r] == 0, want == 0)
    assert (got[1] == 0).any()
    np.testing.assert_array_equal(got[2], np.eye(V)[np.argmax(TARGET, -1)])


def test_the_draft_is_far_from_the_target():
    # So that the broken rules below cannot pass by a draft close to the target: some context's
    # draft conditional is far (total variation) from the target's, under both settings.
    for cfg in (PLAIN, FILTERED):
        q = np.stack([reference_probs(DRAFT[r], **cfg) for r in range(V)])
        p = np.stack([reference_probs(TARGET[r], **cfg) for r in range(V)])
        assert 0.5 * np.abs(p - q).sum(-1).max() > 0.3


def _report(rule, name, result):
    print(f"{rule} {name}: chi2={result[0]:.1f} dof={result[2]} p={result[1]:.3g} in zero cells={result[3]}")


def test_emitted_tokens_have_the_target_joint_law():
    run = make_round()
    for name, cfg in SETTINGS.items():
        result = chi_square(simulate(run, cfg), exact_joint(cfg))
        _report("real rule", name, result)
        assert fits(result), (name, result)


# --- the direct tests: one shape, [SB, SK + 1, SV], so one compile serves them all ------------

SB, SK, SV = 512, 3, V
_verify = jax.jit(rs.rejection_sample)


def _case(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    lg = (rng.standard_normal((SB, SK + 1, SV)) * scale).astype(np.float32)
    q = np.array(jax.nn.softmax(jnp.asarray(rng.standard_normal((SB, SK, SV)).astype(np.float32)), -1))
    return rng, lg, q


# --- greedy rows: today's argmax verify

@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_rows_are_the_argmax_verify(mixed):
    rng, lg, q = _case(1 + mixed)
    best = lg.argmax(-1)
    drafts = np.where(rng.random((SB, SK)) < 0.7, best[:, :SK], rng.integers(0, SV, (SB, SK))).astype(np.int32)
    num_drafts = rng.integers(0, SK + 1, SB).astype(np.int32)
    num_drafts[:4] = [0, SK, SK, 1]
    drafts[1] = best[1, :SK]  # every draft kept: the bonus
    drafts[3, 1:] = -5  # padding past num_drafts is never read
    s = settings(SB, temperature=0.0, top_k=3, top_p=0.5)
    if mixed:  # half the batch samples, so the greedy rows take the mixed branch
        s = s._replace(temperature=np.where(np.arange(SB) % 2 == 1, 0.8, 0.0).astype(np.float32))
    tokens, n = (np.asarray(a) for a in _verify(lg, q, drafts, num_drafts, s))
    greedy = np.flatnonzero(s.temperature == 0)
    for b in greedy:
        want = greedy_accept(drafts[b, :num_drafts[b]].tolist(), best[b, :num_drafts[b] + 1].tolist())
        assert tokens[b].tolist() == want + [-1] * (SK + 1 - len(want)), b
        assert n[b] == len(want) - 1
    assert n[1] == SK and tokens[1, SK] == best[1, SK]  # the bonus after all SK
    assert n[0] == 0 and tokens[0].tolist() == [best[0, 0], -1, -1, -1]  # no drafts: the argmax
    assert len(set(n[greedy].tolist())) == SK + 1  # every accepted count occurs


# --- reproducibility

def test_same_seed_and_step_same_output_whatever_the_batch_mates():
    rng, lg, q = _case(5, scale=2.0)
    drafts = rng.integers(0, SV, (SB, SK)).astype(np.int32)
    nd = np.full(SB, SK, np.int32)
    s = settings(SB, temperature=0.9, seed=77, step=3)
    a = [np.asarray(x) for x in _verify(lg, q, drafts, nd, s)]
    b = [np.asarray(x) for x in _verify(lg, q, drafts, nd, s)]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert 0 < a[1].mean() < SK  # some drafts kept, some rejected: both draws on the path
    # Rows 0..7 again, next to other rows: other logits, drafts, counts, seeds and settings
    # (greedy rows, top-k and top-p on), and at other indices (reversed).
    rng2, lg2, q2 = _case(6, scale=2.0)
    drafts2 = rng2.integers(0, SV, (SB, SK)).astype(np.int32)
    nd2 = rng2.integers(0, SK + 1, SB).astype(np.int32)
    s2 = settings(SB, temperature=0.5, top_k=2, top_p=0.6, seed=5, step=40)
    s2.temperature[::3] = 0.0
    at = np.arange(8)[::-1] + 100  # row r of the first batch sits at index at[r]
    for x2, x in [(lg2, lg), (q2, q), (drafts2, drafts), (nd2, nd)]:
        x2[at] = x[:8]
    s2 = SamplingArrays(*(np.asarray(y).copy() for y in s2))
    for y2, y in zip(s2, s):
        y2[at] = np.asarray(y)[:8]
    c = [np.asarray(x) for x in _verify(lg2, q2, drafts2, nd2, s2)]
    np.testing.assert_array_equal(c[0][at], a[0][:8])
    np.testing.assert_array_equal(c[1][at], a[1][:8])


def test_the_output_depends_on_seed_and_step():
    lg = np.zeros((SB, SK + 1, SV), np.float32)  # p = q uniform: every draft kept ...
    q = np.full((SB, SK, SV), 1.0 / SV, np.float32)
    drafts = np.zeros((SB, SK), np.int32)
    bonus = []
    for seed, step in [(100, 0), (100, 1), (200, 0)]:
        tokens, n = _verify(lg, q, drafts, np.full(SB, SK, np.int32), settings(SB, seed=seed, step=step))
        assert (np.asarray(n) == SK).all()
        bonus.append(np.asarray(tokens)[:, SK])  # ... and the bonus is a uniform draw
    for x in bonus[1:]:
        assert (x != bonus[0]).mean() > 0.8  # unrelated draws agree 1 time in SV


# --- edge cases

def _edge(probs, q, draft, **s_kw):
    """SB rows (distinct seeds) verifying one draft at position 0 against target logits
    log(probs) (SV wide, -1e30 past len(probs)) and draft probabilities q: (tokens, n)."""
    row = np.full(SV, -1e30, np.float32)
    row[:len(probs)] = np.log(probs)
    lg = np.tile(row, (SB, SK + 1, 1))
    qq = np.zeros((SB, SK, SV), np.float32)
    qq[:, :, :len(q)] = q
    drafts = np.full((SB, SK), 7, np.int32)
    drafts[:, 0] = draft
    tokens, n = _verify(lg, qq, drafts, np.ones(SB, np.int32), settings(SB, **s_kw))
    tokens, n = np.asarray(tokens), np.asarray(n)
    assert ((n == 0) | (n == 1)).all() and (tokens[:, 2:] == -1).all()
    assert ((tokens[:, :2] >= 0) | (np.arange(2) > n[:, None])).all()
    return tokens, n


PROBS = [0.4, 0.3, 0.2, 0.1]


def test_a_draft_the_draft_could_not_have_drawn_is_rejected():
    # q(x) = 0: p/q is undefined; rejected, no NaN, and the correction is drawn from
    # max(0, p - q) = [0.4, 0, 0, 0.1].
    tokens, n = _edge(PROBS, [0.0, 0.5, 0.5, 0.0], 0)
    assert (n == 0).all() and set(tokens[:, 0].tolist()) == {0, 3} and (tokens[:, 1] == -1).all()
    assert abs((tokens[:, 0] == 0).mean() - 0.8) < 0.07
    for bad in (-1, SV, 10**6):  # out of range: rejected, the correction from max(0, p - q)
        tokens, n = _edge(PROBS, [0.1] * 4, bad)
        assert (n == 0).all() and set(tokens[:, 0].tolist()) == {0, 1, 2}


def test_a_draft_the_target_excludes_is_rejected():
    # top-k 2 leaves p = [4/7, 3/7, 0, ...]: a draft of token 2 (q 0.25) is always rejected, the
    # correction max(0, p - q) lies on {0, 1}; a draft of token 0 (p 0.57 > q 0.25) is always kept.
    tokens, n = _edge(PROBS, [0.25] * 4, 2, top_k=2)
    assert (n == 0).all() and set(tokens[:, 0].tolist()) == {0, 1}
    tokens, n = _edge(PROBS, [0.25] * 4, 0, top_k=2)
    assert (n == 1).all() and (tokens[:, 0] == 0).all() and set(tokens[:, 1].tolist()) == {0, 1}
    # and p(x) < q(x): kept with probability p/q = 0.1 / 0.4
    tokens, n = _edge(PROBS, [0.2, 0.2, 0.2, 0.4], 3)
    assert abs(n.mean() - 0.25) < 0.07


def test_an_all_zero_residual_falls_back_to_p():
    # q = p exactly and a draft p (hence q) gives 0: rejected, max(0, p - q) is all zero, so the
    # correction is drawn from p (support {0, 1} under top-k 2), never a degenerate index.
    row = np.full(SV, -1e30, np.float32)
    row[:4] = np.log(PROBS)
    p = np.asarray(_probs(jnp.asarray(np.tile(row, (3, V, 1))), settings(3, top_k=2)))[0, 0]
    assert p[2] == 0 and p[0] > 0 and p[1] > 0
    tokens, n = _edge(PROBS, p[:4], 2, top_k=2)
    assert (n == 0).all() and set(tokens[:, 0].tolist()) == {0, 1}
    assert abs((tokens[:, 0] == 0).mean() - 4 / 7) < 0.07
    tokens, n = _edge(PROBS, p[:4], 1, top_k=2)  # q = p and q(x) > 0: always kept
    assert (n == 1).all()


# --- broken rules fail the exactness test (last: swapping a mutant in clears jax's caches)

def _accept_always(u, px, qx):
    return jnp.ones_like(px, dtype=bool)


def _resample_from_p(p, q):
    return p


@contextlib.contextmanager
def mutated(name, fn):
    """rejection_sampler.<name> replaced by fn. jax caches a lax.cond branch's trace by its
    function, so the caches are cleared on the way in (the mutant gets traced) and out (later
    tests do not run it)."""
    orig = getattr(rs, name)
    setattr(rs, name, fn)
    jax.clear_caches()
    try:
        yield
    finally:
        setattr(rs, name, orig)
        jax.clear_caches()


@pytest.mark.parametrize("mutant", [("_accept", _accept_always), ("_residual", _resample_from_p)],
                         ids=["accept_always", "resample_from_p"])
def test_broken_rules_fail_the_same_test(mutant):
    with mutated(*mutant):
        run = make_round()
        for name, cfg in SETTINGS.items():
            result = chi_square(simulate(run, cfg), exact_joint(cfg))
            _report(mutant[1].__name__, name, result)
            assert result[1] < ALPHA, (name, result)  # the chi-square statistic alone rejects it
            assert not fits(result)


def test_verify_slots_is_rejection_sample_on_the_runners_flat_slots():
    """The step's layout (runner.py: one logit slot per row, then the drafts' slots, in any order,
    with padding) gives the very tokens `rejection_sample` gives on [B, k+1, V] with a one-hot q
    (an n-gram draft), greedy, plain and filtered rows mixed: the same rule, the same keys."""
    rng = np.random.default_rng(31)
    B, k, W = 64, 3, 11
    num_drafts = rng.integers(0, k + 1, B)
    temps = rng.choice([0.0, 0.7, 1.0], B)
    s = host_sampling_arrays([dict(temperature=float(t), top_k=-1 if i % 2 else 5, top_p=0.9 if i % 3 == 0 else 1.0,
                                   min_p=0.0, seed=77 + i, step=3 * i) for i, t in enumerate(temps)])
    logits = rng.standard_normal((B, k + 1, W)).astype(np.float32) * 4
    drafts = np.where(rng.random((B, k)) < 0.8, logits[:, :k].argmax(-1), rng.integers(0, W, (B, k))).astype(np.int32)
    q = np.eye(W, dtype=np.float32)[drafts]
    want_tokens, want_n = (np.asarray(x) for x in rs.rejection_sample(logits, q, drafts, num_drafts, s))
    assert 0 < (want_n > 0).sum() < (num_drafts > 0).sum(), "some rows must keep drafts and some refuse them"
    slots = [(b, i) for b in rng.permutation(B) for i in range(num_drafts[b] + 1)]
    rows = np.array([b for b, _ in slots] + [-1] * 5, np.int32)  # 5 padding slots
    pos = np.array([i for _, i in slots] + [0] * 5, np.int32)
    nxt = np.array([drafts[b, i] if i < num_drafts[b] else -7 for b, i in slots] + [0] * 5, np.int32)
    flat = np.concatenate([np.stack([logits[b, i] for b, i in slots]), np.full((5, W), np.nan, np.float32)])
    tokens, n = (np.asarray(x) for x in rs.verify_slots(flat, rows, pos, nxt, s))
    np.testing.assert_array_equal(n, want_n)
    at = {(int(r), int(p)): j for j, (r, p) in enumerate(zip(rows, pos)) if r >= 0}
    for b in range(B):
        got = [int(tokens[at[b, i]]) for i in range(n[b] + 1)]
        assert got == want_tokens[b, :n[b] + 1].tolist(), f"row {b}"
