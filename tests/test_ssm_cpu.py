"""The CPU stand-ins of mamba_ssm, causal_conv1d and fla (megatron_2d_dev.ssm_cpu) against naive token-by-token
recurrences on random inputs: outputs, final states and the gradients of every input (fp32).

The stand-ins compute chunk by chunk (quadratic form inside a chunk, state carried between chunks) as the real
kernels do; the references here step one token at a time, with nothing chunked or vectorised over time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_2d_dev import ssm_cpu as s

RTOL = 2e-5


def rel(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


def assert_same_function(stand_in, naive, inputs, outputs=1):
    """Forward outputs and the gradients of every tensor input of a random projection of the outputs agree."""
    a, b = leaves(*inputs), leaves(*inputs)
    got, want = stand_in(*a), naive(*b)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    gen = torch.Generator().manual_seed(0)
    loss_a = loss_b = 0.0
    for g, w in list(zip(got, want))[:outputs]:
        assert g.shape == w.shape and rel(g, w) < RTOL, f"output: {rel(g, w):.2e}"
        weight = torch.randn(w.shape, generator=gen)
        loss_a, loss_b = loss_a + (g * weight).sum(), loss_b + (w * weight).sum()
    loss_a.backward()
    loss_b.backward()
    for i, (x, y) in enumerate(zip(a, b)):
        if x is not None and y.grad is not None:
            assert rel(x.grad, y.grad) < RTOL, f"gradient of input {i}: {rel(x.grad, y.grad):.2e}"


def runs(seq_idx_row, length):
    return s.document_segments(seq_idx_row, length)


# ---- naive references ----------------------------------------------------------------------------------------
def naive_conv(x, weight, bias, seq_idx=None, activation=None, initial=None):
    """x [b, d, l]: out[t] = bias + sum_j weight[:, j] x[t - (w-1) + j], taps inside the token's own sequence."""
    b, d, l = x.shape
    w = weight.shape[1]
    out = []
    for t in range(l):
        acc = bias.expand(b, d) if bias is not None else x.new_zeros(b, d)
        for j in range(w):
            src = t - (w - 1) + j
            if src >= 0:
                tap = weight[:, j] * x[:, :, src]
                if seq_idx is not None:
                    tap = tap * (seq_idx[:, src] == seq_idx[:, t])[:, None]
                acc = acc + tap
            elif initial is not None:
                acc = acc + weight[:, j] * initial[:, :, src + w - 1]
        out.append(acc)
    out = torch.stack(out, dim=-1)
    return F.silu(out) if activation else out


def naive_scan(
    x, dt, A, B, C, D=None, z=None, dt_bias=None, initial=None, seq_idx=None, softplus=True, dt_limit=s.UNBOUNDED_DT
):
    """Mamba-2: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, times silu(z_t)."""
    b, l, h, p = x.shape
    rep = h // B.shape[2]
    step = dt + (dt_bias if dt_bias is not None else 0)
    step = F.softplus(step) if softplus else step
    step = step.clamp(min=dt_limit[0], max=dt_limit[1]) if tuple(dt_limit) != s.UNBOUNDED_DT else step
    state = initial if initial is not None else x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(l):
        if seq_idx is not None and t > 0:
            state = state * (seq_idx[:, t] == seq_idx[:, t - 1]).to(x.dtype)[:, None, None, None]
        Bt, Ct = B[:, t].repeat_interleave(rep, dim=1), C[:, t].repeat_interleave(rep, dim=1)  # [b, h, n]
        state = (step[:, t] * A).exp()[..., None, None] * state + step[:, t][..., None, None] * x[:, t][..., None] * Bt[
            :, :, None, :
        ]
        y = (state * Ct[:, :, None, :]).sum(-1)
        if D is not None:
            y = y + x[:, t] * (D[:, None] if D.dim() == 1 else D)
        ys.append(y)
    y = torch.stack(ys, dim=1)
    if z is not None:
        y = y * F.silu(z)
    return y, state


def naive_delta_rule(q, k, v, g, beta, scale, initial=None):
    """S_t = exp(g_t) S_{t-1}; S_t += k_t (beta_t (v_t - k_t^T S_t))^T; o_t = scale q_t^T S_t (one sequence)."""
    b, t_len, h, kd = q.shape
    state = initial if initial is not None else q.new_zeros(b, h, kd, v.shape[-1])
    outs = []
    for t in range(t_len):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t][..., None]).sum(-2)) * beta[:, t][..., None]
        state = state + k[:, t][..., None] * delta[:, :, None, :]
        outs.append((state * (scale * q[:, t])[..., None]).sum(-2))
    return torch.stack(outs, dim=1), state


# ---- causal_conv1d -------------------------------------------------------------------------------------------
def random_seq_idx(gen, b, l):
    cuts = sorted(torch.randperm(l - 1, generator=gen)[:3].add(1).tolist())
    row = torch.zeros(l, dtype=torch.int32)
    for c in cuts:
        row[c:] += 1
    return row.expand(b, l).contiguous()


@pytest.mark.parametrize("case", ["plain", "silu+bias", "seq_idx", "initial+final"])
def test_causal_conv1d_fn_equals_naive_convolution(case):
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = (
        torch.randn(2, 6, 23, generator=gen),
        torch.randn(6, 4, generator=gen),
        torch.randn(6, generator=gen),
    )
    kwargs = {}
    if case == "plain":
        bias = None
    if case in ("silu+bias", "seq_idx"):
        kwargs["activation"] = "silu"
    if case == "seq_idx":
        kwargs["seq_idx"] = random_seq_idx(gen, 2, 23)
    initial = torch.randn(2, 6, 3, generator=gen) if case == "initial+final" else None
    stand_in = lambda x, w, b, i: s.causal_conv1d_fn(  # noqa: E731
        x, w, b, initial_states=i, **kwargs, return_final_states=i is not None
    )

    def naive(x, w, b, i):
        final = (torch.cat([i, x], -1)[..., -3:],) if i is not None else ()
        return (naive_conv(x, w, b, kwargs.get("seq_idx"), kwargs.get("activation"), i),) + final

    assert_same_function(stand_in, naive, [x, weight, bias, initial], outputs=2)


def test_varlen_states_are_the_last_inputs_of_each_sequence():
    x = torch.arange(30.0).reshape(10, 3)
    states = s.causal_conv1d_varlen_states(x, torch.tensor([0, 2, 10]), state_len=4)
    assert torch.equal(states[0], torch.cat([torch.zeros(3, 2), x[0:2].t()], dim=1))
    assert torch.equal(states[1], x[6:10].t())


# ---- mamba_ssm -----------------------------------------------------------------------------------------------
SCAN_CASES = {
    "one chunk": dict(l=12, chunk=16),
    "chunks + padding, groups, D per channel, z": dict(l=37, chunk=8, groups=2, d_hdim=True, z=True),
    "dt_limit, no softplus": dict(l=20, chunk=8, softplus=False, dt_limit=(0.01, 0.5)),
    "initial and final states": dict(l=21, chunk=8, initial=True),
    "packed sequences (seq_idx)": dict(l=29, chunk=8, seq_idx=True, z=True),
}


@pytest.mark.parametrize("name", SCAN_CASES)
def test_mamba_chunk_scan_combined_equals_recurrence(name):
    c = SCAN_CASES[name]
    gen = torch.Generator().manual_seed(2)
    b, l, h, p, n, g = 2, c["l"], 4, 3, 5, c.get("groups", 1)
    x, dt = torch.randn(b, l, h, p, generator=gen), torch.randn(b, l, h, generator=gen)
    A = -torch.rand(h, generator=gen) - 0.5
    B, C = torch.randn(b, l, g, n, generator=gen), torch.randn(b, l, g, n, generator=gen)
    D = torch.randn(h, p, generator=gen) if c.get("d_hdim") else torch.randn(h, generator=gen)
    z = torch.randn(b, l, h, p, generator=gen) if c.get("z") else None
    dt_bias = torch.randn(h, generator=gen)
    initial = torch.randn(b, h, p, n, generator=gen) if c.get("initial") else None
    seq_idx = random_seq_idx(gen, b, l) if c.get("seq_idx") else None
    softplus, dt_limit = c.get("softplus", True), c.get("dt_limit", s.UNBOUNDED_DT)
    if not softplus:
        dt = dt.abs()

    def stand_in(x, dt, A, B, C, D, z, dt_bias, initial):
        return s.mamba_chunk_scan_combined(
            x,
            dt,
            A,
            B,
            C,
            c["chunk"],
            D=D,
            z=z,
            dt_bias=dt_bias,
            initial_states=initial,
            seq_idx=seq_idx,
            dt_softplus=softplus,
            dt_limit=dt_limit,
            return_final_states=initial is not None,
        )

    def naive(x, dt, A, B, C, D, z, dt_bias, initial):
        y, final = naive_scan(x, dt, A, B, C, D, z, dt_bias, initial, seq_idx, softplus, dt_limit)
        return (y, final) if initial is not None else y

    assert_same_function(stand_in, naive, [x, dt, A, B, C, D, z, dt_bias, initial], outputs=2)


@pytest.mark.parametrize("rmsnorm", [False, True])
def test_mamba_split_conv1d_scan_combined_equals_conv_then_recurrence(rmsnorm):
    """Megatron's training call (headdim, ngroups, seq_idx; its gate z through silu, no norm inside) and the
    variant with the gated RMSNorm inside."""
    gen = torch.Generator().manual_seed(3)
    b, l, h, p, n, g = 1, 26, 4, 3, 4, 2
    dim = h * p
    zxbcdt = torch.randn(b, l, 2 * dim + 2 * g * n + h, generator=gen)
    weight, bias = torch.randn(dim + 2 * g * n, 4, generator=gen) * 0.5, torch.randn(dim + 2 * g * n, generator=gen)
    dt_bias, A, D = torch.randn(h, generator=gen), -torch.rand(h, generator=gen) - 0.5, torch.randn(h, generator=gen)
    norm_weight = torch.rand(dim, generator=gen) + 0.5 if rmsnorm else None
    seq_idx = random_seq_idx(gen, b, l)

    def stand_in(zxbcdt, weight, bias, dt_bias, A, D, norm_weight):
        return s.mamba_split_conv1d_scan_combined(
            zxbcdt,
            weight,
            bias,
            dt_bias,
            A,
            D,
            8,
            seq_idx=seq_idx,
            rmsnorm_weight=norm_weight,
            headdim=p,
            ngroups=g,
            norm_before_gate=False,
        )

    def naive(zxbcdt, weight, bias, dt_bias, A, D, norm_weight):
        z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * g * n, h], dim=-1)
        xBC = naive_conv(xBC.transpose(1, 2), weight, bias, seq_idx, "silu").transpose(1, 2)
        x, B, C = torch.split(xBC, [dim, g * n, g * n], dim=-1)
        y, _ = naive_scan(
            x.reshape(b, l, h, p),
            dt,
            A,
            B.reshape(b, l, g, n),
            C.reshape(b, l, g, n),
            D,
            None if rmsnorm else z.reshape(b, l, h, p),
            dt_bias,
            seq_idx=seq_idx,
        )
        y = y.reshape(b, l, dim)
        if rmsnorm:
            gated = (y * F.silu(z)).reshape(b, l, g, dim // g)
            y = (gated / (gated.square().mean(-1, keepdim=True) + 1e-6).sqrt()).reshape(b, l, dim) * norm_weight
        return y

    assert_same_function(stand_in, naive, [zxbcdt, weight, bias, dt_bias, A, D, norm_weight])


@pytest.mark.parametrize("before", [True, False])
def test_gated_rmsnorm_module(before):
    gen = torch.Generator().manual_seed(4)
    norm = s.RMSNormGated(12, eps=1e-5, group_size=4, norm_before_gate=before)
    assert torch.equal(norm.weight, torch.ones(12)) and norm.bias is None
    with torch.no_grad():
        norm.weight.copy_(torch.rand(12, generator=gen))
    x, z = torch.randn(3, 12, generator=gen), torch.randn(3, 12, generator=gen)
    xs = x if before else x * F.silu(z)
    grouped = xs.reshape(3, 3, 4)
    out = (grouped / (grouped.square().mean(-1, keepdim=True) + 1e-5).sqrt()).reshape(3, 12) * norm.weight
    out = out * F.silu(z) if before else out
    assert rel(norm(x, z), out) < RTOL
    assert (
        rel(
            norm(x),
            (x.reshape(3, 3, 4) / (x.reshape(3, 3, 4).square().mean(-1, keepdim=True) + 1e-5).sqrt()).reshape(3, 12)
            * norm.weight,
        )
        < RTOL
    )


# ---- fla -----------------------------------------------------------------------------------------------------
DELTA_CASES = {
    "two chunks and a part": dict(t=150),
    "packed sequences": dict(t=90, cu=[0, 17, 80, 90]),
    "initial and final states, scale, qk l2norm in kernel": dict(t=70, initial=True, scale=0.3, l2=True),
    "grouped values": dict(t=40, hv=4),
}


@pytest.mark.parametrize("name", DELTA_CASES)
def test_chunk_gated_delta_rule_equals_recurrence(name):
    c = DELTA_CASES[name]
    gen = torch.Generator().manual_seed(5)
    h, kd, vd, hv = 2, 6, 5, c.get("hv", 2)
    t = c["t"]
    q, k = torch.randn(1, t, h, kd, generator=gen), torch.randn(1, t, h, kd, generator=gen)
    if not c.get("l2"):
        q, k = s.l2norm(q), s.l2norm(k)  # as GDN passes them (normalised before the kernel)
    v = torch.randn(1, t, hv, vd, generator=gen)
    g, beta = -torch.rand(1, t, hv, generator=gen) * 0.5, torch.rand(1, t, hv, generator=gen)
    cu = torch.tensor(c["cu"]) if "cu" in c else None
    initial = torch.randn(1, hv, kd, vd, generator=gen) if c.get("initial") else None
    scale = c.get("scale")

    def stand_in(q, k, v, g, beta, initial):
        return s.chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial,
            output_final_state=initial is not None,
            use_qk_l2norm_in_kernel=c.get("l2", False),
            cu_seqlens=cu,
        )

    def naive(q, k, v, g, beta, initial):
        if c.get("l2"):
            q, k = (x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
        q, k = (x.repeat_interleave(hv // h, dim=2) for x in (q, k))
        bounds = c.get("cu", [0, t])
        outs, final = [], None
        for start, end in zip(bounds[:-1], bounds[1:]):
            o, final = naive_delta_rule(
                q[:, start:end],
                k[:, start:end],
                v[:, start:end],
                g[:, start:end],
                beta[:, start:end],
                scale if scale is not None else kd**-0.5,
                initial,
            )
            outs.append(o)
        return torch.cat(outs, dim=1), final

    assert_same_function(stand_in, naive, [q, k, v, g, beta, initial], outputs=2 if c.get("initial") else 1)


def test_fla_causal_conv1d_keeps_taps_inside_each_sequence():
    gen = torch.Generator().manual_seed(6)
    x, weight, bias = (
        torch.randn(1, 19, 5, generator=gen),
        torch.randn(5, 4, generator=gen),
        torch.randn(5, generator=gen),
    )
    cu = torch.tensor([0, 7, 19])
    seq_idx = torch.tensor([[0] * 7 + [1] * 12])
    assert_same_function(
        lambda x, w, b: s.fla_causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu)[0],
        lambda x, w, b: naive_conv(x.transpose(1, 2), w, b, seq_idx, "silu").transpose(1, 2),
        [x, weight, bias],
    )


def test_l2norm():
    x = torch.randn(4, 7)
    assert rel(s.l2norm(x), x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt()) < 1e-6


def test_arguments_the_stand_ins_do_not_implement_are_refused_by_name():
    x = torch.randn(1, 8, 2, 2)
    with pytest.raises(NotImplementedError, match="does not take cu_seqlens"):
        s.mamba_chunk_scan_combined(
            x,
            torch.rand(1, 8, 2),
            -torch.ones(2),
            torch.randn(1, 8, 1, 2),
            torch.randn(1, 8, 1, 2),
            4,
            cu_seqlens=torch.tensor([0, 8]),
        )
    with pytest.raises(NotImplementedError, match="does not take initial_state"):
        s.fla_causal_conv1d(torch.randn(1, 4, 2), torch.randn(2, 4), initial_state=torch.zeros(1, 2, 4))
