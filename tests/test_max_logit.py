"""The max attention logit (QK-clip) of the op, fast: the blockwise pass against a brute-force fp64 max over the
visible pairs (bands, tiles, GQA, the scale's sign), and attention_2d / latent_attention_2d on 4 forked ranks with
it: the same max on every rank, equal to the brute force, out and gradients bitwise as without it, and Selective
Checkpoint++'s replay giving the kept max without reducing again. The generated cases
(tests/test_generated_attention.py) check it in every layout, mask and packing mode."""

from __future__ import annotations

import pytest
import torch

import megatron_2d
from megatron_2d.kernels.max_logit import band_max_logit
from megatron_2d.layout.band import Band
from megatron_2d.testing.distributed import GROUP_TIMEOUT, run_on_ranks
from megatron_2d.testing.reference import max_logit_reference

TIMEOUT = GROUP_TIMEOUT


def brute_max(q, k, band, scale):
    """[h]: fp64 max of scale * q . k over the pairs ``band`` lets see, from the whole score matrix."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(rep, 2)) * scale
    offset = torch.arange(k.shape[1])[None] - torch.arange(q.shape[1])[:, None]
    hidden = torch.zeros_like(offset, dtype=torch.bool)
    if band is not None and band.lo is not None:
        hidden |= offset < band.lo
    if band is not None and band.hi is not None:
        hidden |= offset > band.hi
    return s.masked_fill(hidden, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize(
    "band, sq, sk",
    [
        (None, 24, 40),
        (Band(None, 0), 32, 32),  # causal square
        (Band(None, 0), 40, 16),  # more queries than keys
        (Band(0, None), 20, 20),  # anti-causal
        (Band(-3, 0), 64, 64),  # a causal window of 4 keys: tiles trimmed to it
        (Band(-2, 5), 48, 30),  # two-sided
        (Band(7, 9), 10, 12),  # rows that see nothing at the bottom
    ],
)
@pytest.mark.parametrize("max_elements", [None, 64])  # 64: tiles of a row or two
def test_band_max_logit_is_the_brute_force_max(band, sq, sk, max_elements):
    g = torch.Generator().manual_seed(sq * sk)
    q, k = torch.randn(2, sq, 4, 8, generator=g), torch.randn(2, sk, 2, 8, generator=g)  # GQA: 2 heads per K/V
    for scale in (0.3, -0.7):
        got = band_max_logit(q, k, band, scale, torch.float32, max_elements)
        want = brute_max(q, k, band, scale)
        assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-5, (scale, got, want)


def test_band_max_logit_of_a_band_that_shows_nothing_is_minus_inf():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    assert torch.equal(band_max_logit(q, k, Band(5, 6), 0.5, torch.float32), torch.full((2,), float("-inf")))


# ---- the op on 4 ranks ------------------------------------------------------------------------------------------
LAYOUTS = [(2, 2, "head_first"), (4, 1, "context_first")]  # (hp, w, placement) of CP 4


def _op_cases(rank, world):
    """Per layout, kernel and mask: (max logit error against the brute force, whether every rank has the same
    max, whether out and the gradients are bitwise those of a call without it); MLA's latent ring; Checkpoint++'s
    replay (the kept max, and the all-reduces it made)."""
    results = {}
    g = torch.Generator().manual_seed(5)
    S, hq, hkv, d = 2 * world * 6, 4, 1, 16  # one K/V head: replicated at hp 2 and 4
    full = [torch.randn(S, 2, h, d, generator=g) for h in (hq, hkv, hkv)]
    shard = lambda x: megatron_2d.shard_sequence(x, rank, world)  # noqa: E731
    for hp, w, placement in LAYOUTS:
        groups = megatron_2d.build_2d_groups(hp, w, placement, timeout=TIMEOUT)
        for kernel in ("cpu_flash", "torch_math"):
            for causal, window in ((True, (-1, -1)), (False, (5, 2))):
                runs = []
                for with_max in (True, False):
                    leaves = [shard(x).requires_grad_(True) for x in full]
                    out = megatron_2d.attention_2d(
                        *leaves, groups, causal=causal, sliding_window=window, kernel=kernel,
                        return_max_logit=with_max,
                    )  # fmt: skip
                    out, m = out if with_max else (out, None)
                    out.backward(torch.ones_like(out))
                    runs.append((out.detach(), *(x.grad for x in leaves), m))
                want = max_logit_reference(full[0], full[1], [0, S], causal, d**-0.5, window)
                gathered = [torch.empty_like(runs[0][-1]) for _ in range(world)]
                torch.distributed.all_gather(gathered, runs[0][-1])
                results[(hp, w, kernel, causal, window)] = (
                    (runs[0][-1].double() - want).abs().max().item() / want.abs().max().item(),
                    all(torch.equal(x, gathered[0]) for x in gathered),
                    all(torch.equal(a, b) for a, b in zip(runs[0][:-1], runs[1][:-1])),
                )
        groups.destroy()
    # MLA's latent ring: q [s, b, h, dn + dr], latent [s, b, r + dr]; the max over q . k with k = [c W_k, k_rope]
    groups = megatron_2d.build_2d_groups(2, None, "head_first", timeout=TIMEOUT)
    dn, dr, dv, r = 8, 4, 8, 6
    q, latent = torch.randn(S, 1, hq, dn + dr, generator=g), torch.randn(S, 1, r + dr, generator=g)
    weight = torch.randn(hq * (dn + dv), r, generator=g)
    _, m = megatron_2d.latent_attention_2d(
        shard(q), shard(latent), weight, groups, nope_dim=dn, value_dim=dv, kernel="torch_math", return_max_logit=True
    )
    kv = (latent[..., :r] @ weight.t()).unflatten(-1, (hq, dn + dv))  # [S, 1, hq, dn + dv]
    k = torch.cat([kv[..., :dn], latent[..., r:].unsqueeze(2).expand(-1, -1, hq, -1)], dim=-1)
    want = max_logit_reference(q, k, [0, S], True, (dn + dr) ** -0.5)
    results["latent"] = (m.double() - want).abs().max().item() / want.abs().max().item()
    # Selective Checkpoint++: the first pass records the reduced max; the replay gives it back, reducing nothing
    from megatron_2d.attention import run_attention_2d
    from megatron_2d.call.options import AttentionOptions
    from megatron_2d.kept_forward import KeptForward

    leaves = [shard(x) for x in full]
    kept = KeptForward("outputs", leaves)
    kept_options = AttentionOptions(return_max_logit=True, kept=kept)  # Selective Checkpoint++'s record of the call
    with torch.no_grad():
        _, first = run_attention_2d(*leaves, groups, kept_options)
    kept.start_replay()
    reductions, all_reduce = [], torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **kw: reductions.append(1) or all_reduce(*a, **kw)
    try:
        _, again = run_attention_2d(*leaves, groups, kept_options)
    finally:
        torch.distributed.all_reduce = all_reduce
    results["replay"] = (torch.equal(first, again), len(reductions))
    return results


@pytest.fixture(scope="module")
def op_results():
    return run_on_ranks(4, _op_cases, timeout_s=180)


@pytest.mark.distributed
def test_the_ops_max_logit_is_exact_and_changes_nothing_else(op_results):
    """CP 4 in two layouts (2D hp 2 x cp 2 with a double ring of 2; heads only, hp 4), K/V replicated, cpu_flash and
    torch_math, causal and a two-sided window: the max is the brute force's within fp32 rounding and the same on
    every rank, and out, dq, dk, dv are bitwise those of the call without it (every layout, mask and packing mode:
    tests/test_generated_attention.py)."""
    for results in op_results:
        cases = {key: value for key, value in results.items() if isinstance(key, tuple)}
        assert len(cases) == len(LAYOUTS) * 2 * 2
        for case, (error, same, unchanged) in cases.items():
            assert error < 2e-6 and same and unchanged, (case, error, same, unchanged)


@pytest.mark.distributed
def test_the_latent_rings_max_logit_uses_the_up_projected_keys(op_results):
    assert all(results["latent"] < 2e-6 for results in op_results)


@pytest.mark.distributed
def test_checkpoint_plus_plus_replays_the_kept_max(op_results):
    assert all(results["replay"] == (True, 0) for results in op_results)
