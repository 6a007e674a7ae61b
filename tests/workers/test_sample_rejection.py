"""MTP acceptance for a batch (workers/sample/rejection.py): greedy exactness against a
per-row loop, and rejection sampling leaving the target distribution."""

from __future__ import annotations

import pytest
import torch

from tests.workers.test_sample import ref_penalised, ref_probs
from workers.sample.metadata import SamplingMetadata, TokenHistory
from workers.sample.ops.rng import uniforms
from workers.sample.output import AcceptOutput, read_back
from workers.sample.params import SamplingParams
from workers.sample.rejection import accept


def greedy_reference(drafts: list[int], target: torch.Tensor) -> list[int]:
    """The rule one request at a time: accept while draft == argmax, then the argmax."""
    out = []
    for j, d in enumerate(drafts):
        t = int(target[j].argmax())
        if d != t:
            return out + [t]
        out.append(d)
    return out + [int(target[len(drafts)].argmax())]


def test_greedy_acceptance_is_exact():
    torch.manual_seed(0)
    r, k, v = 64, 3, 50
    target = torch.randn(r, k + 1, v)
    drafts = target[:, :k].argmax(-1)
    # Break each row's drafts at a random position (or never): every count 0..k occurs.
    cut = torch.arange(r) % (k + 1)
    for i in range(r):
        if cut[i] < k:
            drafts[i, cut[i]] = (drafts[i, cut[i]] + 1) % v
    params = [SamplingParams(logprobs=2 if i % 5 == 0 else None) for i in range(r)]
    meta = SamplingMetadata.build(params, [None] * r, [0] * r, "cpu")
    out = accept(target, drafts, meta)
    rows = AcceptOutput.unpack(read_back(out.packed())[0].tolist(), k + 1, meta.top_logprobs)
    lp = torch.log_softmax(target, -1)
    for i in range(r):
        want = greedy_reference(drafts[i].tolist(), target[i])
        assert [s.token for s in rows[i]] == want and out.num_accepted[i] == len(want) - 1 == cut[i]
        assert [s.logprob for s in rows[i]] == pytest.approx([lp[i, j, t].item() for j, t in enumerate(want)], abs=1e-5)
        assert (rows[i][0].top_logprobs is not None) == (i % 5 == 0)
    assert out.tokens[cut < k - 1, -1].eq(-1).all()


def test_greedy_acceptance_with_penalties_counts_earlier_drafts():
    torch.manual_seed(1)
    r, k, v = 16, 3, 12
    target = torch.randn(r, k + 1, v) * 2
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.6, presence_penalty=0.3) for _ in range(r)]
    prompts = [[i % v, (i + 1) % v] for i in range(r)]
    outputs = [[(i + 2) % v] for i in range(r)]
    # Drafts = the penalised argmax of each position given the drafts before it: all accepted.
    drafts = torch.zeros(r, k, dtype=torch.long)
    for i in range(r):
        for j in range(k):
            drafts[i, j] = ref_penalised(target[i, j], params[i], prompts[i], outputs[i] + drafts[i, :j].tolist()).argmax()
    meta = SamplingMetadata.build(params, [None] * r, [0] * r, "cpu")
    out = accept(target, drafts, meta, history=TokenHistory.build(prompts, outputs, "cpu"))
    assert out.num_accepted.eq(k).all()
    bonus = [int(ref_penalised(target[i, k], params[i], prompts[i], outputs[i] + drafts[i].tolist()).argmax())
             for i in range(r)]
    assert out.tokens[:, k].tolist() == bonus


@pytest.mark.parametrize("k", [1, 2])
def test_rejection_sampling_preserves_the_target_distribution(k):
    """Drafts drawn from q, accepted by the rule: each emitted token ~ p exactly."""
    n, v = 40_000, 5
    p_logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, -0.5, 1.0, 0.2]])[:k]
    bonus_logits = torch.tensor([0.3, -1.0, 2.0, 0.0, 0.5])
    q = torch.tensor([[0.05, 0.5, 0.2, 0.2, 0.05], [0.3, 0.1, 0.1, 0.1, 0.4]])[:k]
    params = SamplingParams(temperature=0.9, top_k=4)
    p = torch.stack([ref_probs(x, params) for x in torch.cat([p_logits, bonus_logits[None]])]).float()
    # Drafts from q with the same kind of counter uniforms (another seed: independent of the rule's).
    u = uniforms(torch.tensor([77]), torch.arange(n)[:, None], torch.arange(k)[None, :])
    drafts = torch.searchsorted(q.cumsum(-1).expand(n, k, v).contiguous(), u[..., None]).squeeze(-1).clamp(max=v - 1)
    target = torch.cat([p_logits, bonus_logits[None]]).expand(n, k + 1, v).contiguous()
    meta = SamplingMetadata.build([params] * n, [3] * n, list(range(n)), "cpu")
    out = accept(target, drafts, meta, q.expand(n, k, v).contiguous())
    assert out.num_accepted.min() == 0 and out.num_accepted.max() == k

    def chi2(tokens: torch.Tensor, want: torch.Tensor) -> float:
        counts = torch.bincount(tokens, minlength=v).double()
        assert counts[want == 0].sum() == 0
        exp = len(tokens) * want[want > 0].double()
        return ((counts[want > 0] - exp) ** 2 / exp).sum().item()

    assert chi2(out.tokens[:, 0], p[0]) < 25  # <= 4 dof: p < 1e-4
    if k == 2:  # the second token, where the first draft was accepted, ~ p at position 1
        assert chi2(out.tokens[out.num_accepted >= 1, 1], p[1]) < 25
    # and the naive "always accept the draft" would be far off
    assert (q[0] - p[0]).abs().max() > 0.2


def test_mixed_batch_greedy_rows_unaffected_and_sampled_rows_reproducible():
    torch.manual_seed(3)
    r, k, v = 6, 2, 30
    target = torch.randn(r, k + 1, v)
    drafts = torch.randint(0, v, (r, k))
    drafts[0] = target[0, :k].argmax(-1)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=0.7, seed=3),
              SamplingParams()]
    q = torch.softmax(torch.randn(r, k, v), -1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]

    def run(rows):
        ps = [params[i] for i in rows]
        meta = SamplingMetadata.build(ps, [p.seed for p in ps], [5] * len(rows), "cpu")
        qs = [q[i] for i in rows if not params[i].greedy]
        out = accept(target[rows], drafts[rows], meta, torch.stack(qs) if qs else None)
        return out.tokens.tolist()

    together = run(list(range(r)))
    for i in range(r):
        assert run([i]) == [together[i]]
        if params[i].greedy:
            assert together[i][: len(greedy_reference(drafts[i].tolist(), target[i]))] == \
                greedy_reference(drafts[i].tolist(), target[i])
    assert run(sampled[::-1]) == [together[i] for i in sampled[::-1]]
