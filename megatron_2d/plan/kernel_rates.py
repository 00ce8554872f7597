"""Which attention kernel each side runs, and the share of peak each kernel reaches, by GPU architecture.

    stock (Megatron CP)  Transformer Engine's choice: FusedAttention (cuDNN) on Hopper and later, flash-attn 2 before
                         (TE's ``get_attention_backend``, ``attention/dot_product_attention/utils.py``: "Disabling
                         FlashAttention to give FusedAttention preference on Hopper+ for performance reasons");
                         DeepSpeed-Ulysses (Megatron-DeepSpeed) runs flash-attn 2 as its local attention
    2D (megatron_2d)     what ``megatron_2d.kernels`` selects where stock runs (TE importable): te_fused on Hopper,
                         flash_attn2 before; ``--kernel`` runs another (then the flags carry ``--cp-2d-kernel``)

Efficiencies are forward + backward together, flops-weighted (the backward does 2.5x the forward's FLOPs):
``3.5 / (1 / fwd + 2.5 / bwd)`` over the peak, from published single-GPU figures at long blocks (16K tokens, head
dim 128); a ring step's blocks are shorter and run lower, which a calibration (``megatron_2d.plan.calibrate``,
``--attn-eff``) replaces with a measurement. Rows marked estimated have no published figure of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout.choices import Kernel, PlanKind
from ..layout.costs import H100_CUDNN_EFFICIENCY, fwd_bwd_efficiency
from .errors import PlanError

ARCHITECTURES = ("ampere", "hopper")

FA3_PAPER = "FlashAttention-3 paper (Shah et al., arXiv 2407.08608), H100 SXM5, head dim 128, 16K tokens"
FA2_PAPER = "FlashAttention-2 paper (Dao, arXiv 2307.08691), A100"


@dataclass(frozen=True)
class KernelRate:
    """One kernel's share of peak on one architecture, and where the figure comes from."""

    efficiency: float
    source: str
    estimated: bool = False


_CUDNN_H100 = H100_CUDNN_EFFICIENCY  # the paper's cuDNN bars: causal forward 539, backward 516 TFLOP/s
_FA2_H100 = fwd_bwd_efficiency(335, 322, 989)  # its FlashAttention-2 bars

_CUDNN_AMPERE = KernelRate(0.45, "cuDNN before Hopper: no published figure used", estimated=True)
_TORCH_FLASH = "PyTorch's copy of FlashAttention-2's kernels"
RATES_BY_KERNEL: dict[Kernel, dict[str, KernelRate]] = {
    Kernel.TE_FUSED: {
        "hopper": KernelRate(_CUDNN_H100, f"{FA3_PAPER}: cuDNN 539 TFLOP/s causal forward, 516 backward"),
        "ampere": _CUDNN_AMPERE,
    },
    Kernel.TORCH_CUDNN: {
        "hopper": KernelRate(
            _CUDNN_H100, "the same cuDNN kernels as te_fused, through PyTorch's ops (pieces for bands)", estimated=True
        ),
        "ampere": _CUDNN_AMPERE,
    },
    Kernel.FLASH_ATTN2: {
        "hopper": KernelRate(_FA2_H100, f"{FA3_PAPER}: FlashAttention-2 335 TFLOP/s causal forward, 322 backward"),
        "ampere": KernelRate(
            0.5, f"{FA2_PAPER}: 50-73% of peak forward, up to 72% forward + backward; 0.5 assumed for ring blocks"
        ),
    },
    Kernel.TORCH_FLASH: {
        "hopper": KernelRate(_FA2_H100, _TORCH_FLASH, estimated=True),
        "ampere": KernelRate(0.5, _TORCH_FLASH, estimated=True),
    },
}
"""The planner's cost of each kernel (:class:`megatron_2d.layout.choices.Kernel`): its rate by architecture. The
CPU kernels (cpu_flash, torch_math) have none: the planner prices GPU clusters."""
KERNEL_RATES: dict[tuple[str, str], KernelRate] = {
    (arch, kernel): rate for kernel, by_arch in RATES_BY_KERNEL.items() for arch, rate in by_arch.items()
}
""":data:`RATES_BY_KERNEL` by (architecture, kernel)."""
STOCK_KERNEL = {"hopper": Kernel.TE_FUSED, "ampere": Kernel.FLASH_ATTN2}
"""The kernel Transformer Engine runs for stock CP (see the module)."""
SELECTED_KERNEL = {"hopper": Kernel.TE_FUSED, "ampere": Kernel.FLASH_ATTN2}
"""What megatron_2d.kernels selects where stock runs: the first of its order per architecture that is installed
with TE (tests/test_plan_kernels.py checks it against the selection)."""
LAUNCH_MAX_LOGIT = (Kernel.TE_FUSED,)
"""The kernels whose launch returns the max attention logit (QK-clip): Transformer Engine's fused attention from 2.9 on
(``fused_attn_fwd(return_max_logit=True)``, cuDNN's row max, assumed installed); every other kernel runs the op's
separate pass (:mod:`megatron_2d.kernels.max_logit`; tests/test_plan_kernels.py checks the two agree)."""
PLANNED_KERNELS = tuple(k for k in Kernel if k in RATES_BY_KERNEL)
"""The kernels the planner prices (``--kernel``): the CUDA ones."""


def kernel_rate(arch: str, kernel: str) -> KernelRate:
    """The rate of ``kernel`` on ``arch``, or PlanError naming the valid ones."""
    if arch not in ARCHITECTURES:
        raise PlanError(f"cluster arch {arch!r} is not one of {list(ARCHITECTURES)}")
    if (arch, kernel) not in KERNEL_RATES:
        raise PlanError(f"kernel {kernel!r} is not one the planner prices; choose one of {list(PLANNED_KERNELS)}")
    return KERNEL_RATES[(arch, kernel)]


def side_kernel(kind: str, arch: str, kernel: str | None = None, qk_clip: bool = False) -> str:
    """The kernel a layout of ``kind`` runs: Megatron's stock kinds TE's (:data:`STOCK_KERNEL`; with ``qk_clip``
    its fused attention: TE switches FlashAttention off for ``return_max_logit``, ``get_attention_backend``),
    DeepSpeed-Ulysses flash-attn 2, 2D ``kernel`` or the selection's (:data:`SELECTED_KERNEL`)."""
    if kind == PlanKind.DS_ULYSSES:
        return Kernel.FLASH_ATTN2
    if kind != PlanKind.TWO_D:
        return Kernel.TE_FUSED if qk_clip else STOCK_KERNEL[arch]
    chosen = SELECTED_KERNEL[arch] if kernel is None else kernel
    kernel_rate(arch, chosen)  # validated
    return chosen
