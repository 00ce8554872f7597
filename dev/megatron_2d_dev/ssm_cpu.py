"""Pure-torch CPU stand-ins for the kernels Megatron's Mamba and GDN layers import: test support only.

megatron-core's ``MambaMixer`` imports ``mamba_chunk_scan_combined``, ``mamba_split_conv1d_scan_combined`` and the
gated ``RMSNorm`` from mamba_ssm and ``causal_conv1d_fn`` from causal_conv1d; ``GatedDeltaNet`` imports fla's
``chunk_gated_delta_rule``, ``l2norm`` and ``causal_conv1d``. Those packages run CUDA or Triton kernels only. The
functions here take the same arguments and compute the same math on any device, chunked as the real kernels are
(intra-chunk quadratic form, state passed between chunks); the tests check them against a naive token-by-token
recurrence (tests/test_ssm_cpu.py). Arguments the layers never pass in training (varlen states for inference,
initial states combined with packed sequences, non-SSM channels) are refused by name.

:mod:`megatron_2d_dev.hybrid_cpu` installs them under the real packages' module names, by explicit call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

UNBOUNDED_DT = (0.0, float("inf"))


def _refuse(name: str, value, what: str) -> None:
    if value is not None and value is not False:
        raise NotImplementedError(
            f"the CPU stand-in of {what} does not take {name} (Megatron's training path does not pass it)"
        )


def document_segments(seq_idx_row: torch.Tensor | None, length: int) -> list[tuple[int, int]]:
    """[start, end) runs of equal ``seq_idx`` (one packed sequence each); the whole row without seq_idx."""
    if seq_idx_row is None:
        return [(0, length)]
    ids = seq_idx_row.tolist()
    bounds = [0] + [t for t in range(1, length) if ids[t] != ids[t - 1]] + [length]
    return list(zip(bounds[:-1], bounds[1:]))


# --------------------------------------------------------------------------------------------------
# causal_conv1d
# --------------------------------------------------------------------------------------------------
def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """causal_conv1d's ``causal_conv1d_fn``: depthwise causal convolution. x [b, d, l], weight [d, w], bias [d],
    seq_idx [b, l] (taps never cross into another packed sequence), initial_states [b, d, w - 1]; -> [b, d, l]
    (and the final states [b, d, w - 1] with ``return_final_states``)."""
    _refuse("final_states_out", final_states_out, "causal_conv1d_fn")
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"activation {activation!r}: causal_conv1d supports None, 'silu', 'swish'")
    if seq_idx is not None and initial_states is not None:
        raise NotImplementedError("the CPU stand-in of causal_conv1d_fn takes seq_idx or initial_states, not both")
    batch, dim, length = x.shape
    width = weight.shape[1]
    xf = x.float()
    history = initial_states.float() if initial_states is not None else xf.new_zeros(batch, dim, width - 1)
    padded = torch.cat([history, xf], dim=-1)  # [b, d, w - 1 + l]
    out = xf.new_zeros(batch, dim, length) if bias is None else bias.float()[None, :, None].expand(batch, dim, length)
    if seq_idx is not None:
        own = seq_idx.to(torch.long)
        seq_padded = torch.cat([own.new_full((batch, width - 1), -1), own], dim=-1)
    for tap in range(width):  # tap w - 1 reads the current token, tap j the token w - 1 - j before it
        term = weight.float()[None, :, tap, None] * padded[..., tap : tap + length]
        if seq_idx is not None:
            term = term * (seq_padded[:, tap : tap + length] == own)[:, None, :]
        out = out + term
    if activation is not None:
        out = F.silu(out)
    out = out.to(x.dtype)
    if return_final_states:
        return out, padded[..., padded.shape[-1] - (width - 1) :].to(x.dtype)
    return out


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """causal_conv1d's ``causal_conv1d_varlen_states``: x [total, d] -> [n, d, state_len], the last state_len
    inputs of each sequence (zeros before a short sequence's start)."""
    bounds = cu_seqlens.tolist()
    states = x.new_zeros(len(bounds) - 1, x.shape[1], state_len)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        take = min(state_len, end - start)
        if take:
            states[i, :, state_len - take :] = x[end - take : end].t()
    return states


# --------------------------------------------------------------------------------------------------
# mamba_ssm: state-space duality scan, chunked
# --------------------------------------------------------------------------------------------------
def _ssd_chunked(x, dt, A, B, C, chunk_size: int, initial_state):
    """One packed sequence: x [b, l, h, p], dt [b, l, h] (final step sizes), A [h], B, C [b, l, h, n] (per head),
    initial_state [b, h, p, n] or None, all fp32. Returns y [b, l, h, p] and the final state [b, h, p, n].

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t, computed per chunk of ``chunk_size`` tokens as the
    real kernel does: the quadratic form inside a chunk plus the state carried in from the chunks before."""
    batch, length, heads, headdim = x.shape
    pad = (-length) % chunk_size
    if pad:  # dt = 0 on padding: no decay, no input
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    chunks = x.shape[1] // chunk_size
    x, B, C = (t.reshape(batch, chunks, chunk_size, heads, -1) for t in (x, B, C))  # [b, c, Q, h, .]
    dt = dt.reshape(batch, chunks, chunk_size, heads)
    cumulative = torch.cumsum(dt * A, dim=2)  # [b, c, Q, h] log decay from chunk start
    gap = cumulative[:, :, :, None, :] - cumulative[:, :, None, :, :]  # [b, c, Q(i), Q(j), h]: i after j
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.where(causal[None, None, :, :, None], gap, gap.new_full((), -math.inf)).exp()
    scores = torch.einsum("bcihn,bcjhn->bcijh", C, B) * decay  # [b, c, Q, Q, h]
    y = torch.einsum("bcijh,bcjh,bcjhp->bcihp", scores, dt, x)
    to_end = (cumulative[:, :, -1:, :] - cumulative).exp() * dt  # [b, c, Q, h]
    chunk_states = torch.einsum("bcjhn,bcjh,bcjhp->bchpn", B, to_end, x)  # [b, c, h, p, n]
    state = x.new_zeros(batch, heads, headdim, B.shape[-1]) if initial_state is None else initial_state
    entering = []
    for c in range(chunks):
        entering.append(state)
        state = cumulative[:, c, -1, :, None, None].exp() * state + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # [b, c, h, p, n]
    y = y + torch.einsum("bcihn,bchpn,bcih->bcihp", C, entering, cumulative.exp())
    return y.reshape(batch, chunks * chunk_size, heads, headdim)[:, :length], state


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=UNBOUNDED_DT,
    return_final_states=False,
    return_varlen_states=False,
):
    """mamba_ssm's ``mamba_chunk_scan_combined``: x [b, l, h, p], dt [b, l, h], A [h], B, C [b, l, g, n],
    D [h] or [h, p], z [b, l, h, p] (output gated by silu(z)), dt_bias [h], initial_states [b, h, p, n],
    seq_idx [b, l] (the state restarts at every new packed sequence). -> y [b, l, h, p] in x's dtype (and the
    final states [b, h, p, n] with ``return_final_states``)."""
    _refuse("cu_seqlens", cu_seqlens, "mamba_chunk_scan_combined")
    _refuse("return_varlen_states", return_varlen_states, "mamba_chunk_scan_combined")
    if seq_idx is not None and (initial_states is not None or return_final_states):
        raise NotImplementedError(
            "the CPU stand-in of mamba_chunk_scan_combined takes seq_idx without initial or final states"
        )
    heads, groups = x.shape[2], B.shape[2]
    step = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        step = F.softplus(step)  # threshold 20, as the kernel's softplus
    if tuple(dt_limit) != UNBOUNDED_DT:
        step = step.clamp(min=dt_limit[0], max=dt_limit[1])
    xf = x.float()
    Bh, Ch = (t.float().repeat_interleave(heads // groups, dim=2) for t in (B, C))  # [b, l, h, n]
    y = torch.empty_like(xf)
    finals = []
    for row in range(x.shape[0]):
        for start, end in document_segments(seq_idx[row] if seq_idx is not None else None, x.shape[1]):
            part = slice(row, row + 1), slice(start, end)
            state = initial_states[row : row + 1].float() if initial_states is not None else None
            y[part], final = _ssd_chunked(xf[part], step[part], A.float(), Bh[part], Ch[part], chunk_size, state)
            finals.append(final)
    if D is not None:
        y = y + xf * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, torch.cat(finals)) if return_final_states else y


def mamba_split_conv1d_scan_combined(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    initial_states=None,
    seq_idx=None,
    dt_limit=UNBOUNDED_DT,
    return_final_states=False,
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    outproj_weight=None,
    outproj_bias=None,
    headdim=None,
    ngroups=1,
    norm_before_gate=True,
):
    """mamba_ssm's ``mamba_split_conv1d_scan_combined``: zxbcdt [b, l, 2*dim + 2*ngroups*dstate + nheads] is split
    into z, xBC, dt; xBC goes through the causal conv (and silu), then the chunked scan with softplus(dt + dt_bias),
    D and the silu(z) gate (or the gated RMSNorm when ``rmsnorm_weight`` is given), then the optional out
    projection. -> [b, l, dim] (or [b, l, out_dim])."""
    nheads, headdim = (D.shape[0], headdim) if D.dim() == 1 else D.shape
    if headdim is None:
        raise ValueError("headdim must be given when D is per head")
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    expected = 2 * dim + 2 * ngroups * dstate + nheads
    if zxbcdt.shape[-1] != expected:
        raise NotImplementedError(
            f"zxbcdt has {zxbcdt.shape[-1]} channels; the CPU stand-in takes exactly z, xBC "
            f"and dt ({expected}), no extra gated-MLP channels"
        )
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d_fn(
        xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation
    ).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    batch, length = x.shape[:2]
    x = x.reshape(batch, length, nheads, headdim)
    B, C = (t.reshape(batch, length, ngroups, dstate) for t in (B, C))
    gate = z.reshape(batch, length, nheads, headdim)
    scanned = mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        z=gate if rmsnorm_weight is None else None,
        dt_bias=dt_bias,
        initial_states=initial_states,
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=dt_limit,
        return_final_states=return_final_states,
    )
    y, final = scanned if return_final_states else (scanned, None)
    out = y.reshape(batch, length, dim)
    if rmsnorm_weight is not None:
        out = rmsnorm_fn(
            out,
            rmsnorm_weight,
            None,
            z=z,
            eps=rmsnorm_eps,
            group_size=dim // ngroups,
            norm_before_gate=norm_before_gate,
        )
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """mamba_ssm's gated RMSNorm: RMSNorm over groups of ``group_size`` channels, times ``weight`` (+ bias), gated
    by silu(z) after the norm (``norm_before_gate``) or before it; computed in fp32, returned in x's dtype."""
    xf = x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    size = group_size or xf.shape[-1]
    grouped = xf.unflatten(-1, (-1, size))  # [..., groups, group_size]
    out = (grouped * torch.rsqrt(grouped.square().mean(dim=-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if z is not None and norm_before_gate:
        out = out * F.silu(z.float())
    return out.to(x.dtype)


class RMSNormGated(torch.nn.Module):
    """mamba_ssm's ``ops.triton.layernorm_gated.RMSNorm`` (Megatron subclasses it as ExtendedRMSNorm)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return rmsnorm_fn(
            x,
            self.weight,
            self.bias,
            z=z,
            eps=self.eps,
            group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )


# --------------------------------------------------------------------------------------------------
# fla: gated delta rule, l2norm, causal conv
# --------------------------------------------------------------------------------------------------
def l2norm(x, eps=1e-6, output_dtype=None):
    """fla's ``l2norm``: x / sqrt(sum(x^2) + eps) over the last dimension, in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().sum(dim=-1, keepdim=True) + eps)
    return out.to(output_dtype or x.dtype)


def _sequence_ids(cu_seqlens, length: int, device) -> torch.Tensor:
    """[1, length] packed-sequence index of every token from cumulative lengths."""
    positions = torch.arange(length, device=device)
    return torch.bucketize(positions, torch.as_tensor(cu_seqlens, device=device)[1:], right=True)[None]


def fla_causal_conv1d(
    x,
    weight=None,
    bias=None,
    residual=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    backend=None,
    cu_seqlens=None,
    **kwargs,
):
    """fla's ``modules.convolution.causal_conv1d``: x [b, t, d] -> (y [b, t, d], None); ``cu_seqlens`` keeps the
    taps inside each packed sequence."""
    for name, value in (
        ("residual", residual),
        ("initial_state", initial_state),
        ("output_final_state", output_final_state),
    ):
        _refuse(name, value, "fla's causal_conv1d")
    seq_idx = _sequence_ids(cu_seqlens, x.shape[1], x.device) if cu_seqlens is not None else None
    out = causal_conv1d_fn(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation=activation)
    return out.transpose(1, 2), None


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    """fla's ``ops.gated_delta_rule.chunk_gated_delta_rule``: q, k [B, T, H, K], v [B, T, HV, V], g (log decay) and
    beta [B, T, HV], initial_state [N, HV, K, V]; ``cu_seqlens`` (B = 1) restarts the state per sequence.
    -> (o [B, T, HV, V] in q's dtype, final states [N, HV, K, V] or None).

    The chunked math is megatron-core's own torch implementation (``torch_chunk_gated_delta_rule``, its
    deterministic-mode path), run per packed sequence, with fla's ``scale`` applied to q."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if v.shape[2] != q.shape[2]:  # grouped values: repeat q/k over the value heads
        q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
    key_dim = q.shape[-1]
    if scale is not None:  # Megatron's implementation scales q by K^-1/2 itself
        q = q * (scale * key_dim**0.5)
    if cu_seqlens is None:
        spans = [(row, 0, q.shape[1]) for row in range(q.shape[0])]
    else:
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch size 1, got {q.shape[0]}")
        bounds = torch.as_tensor(cu_seqlens).tolist()
        spans = [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:])]
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    finals = []
    for n, (row, start, end) in enumerate(spans):
        part = (slice(row, row + 1), slice(start, end))
        state = initial_state[n : n + 1] if initial_state is not None else None
        out[part], final = torch_chunk_gated_delta_rule(
            q[part], k[part], v[part], g[part], beta[part], initial_state=state, output_final_state=True
        )
        finals.append(final)
    return out, (torch.cat(finals) if output_final_state else None)
