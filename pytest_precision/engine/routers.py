"""Mixture-of-experts routers: find them in a model, read each one's expert choice per token, and make a router
choose other experts (routing replay).

A router's choice per token is its top-k expert indices, their routing weights and the router's margin: the gap
between the score of its k-th choice and that of the best expert it did not choose, in the units top-k is taken
over (logits for softmax routers, bias-corrected sigmoid scores for DeepSeek-V3-style ones). A choice is streamed
as one "routing" tensor per router call, (rows, positions, 2k + 1) float64: k indices (ordered as the router returned
them), k weights, the margin. Floats hold the indices exactly (below 2**53).

Known routers: transformers' `*TopKRouter` / `*TopkRouter` modules (transformers >= 5) returning
(router_logits, top_k_weights, top_k_indices). Replay knows the rules of Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral
(softmax, top-k weights renormalised when `norm_topk_prob`) and DeepSeek-V3 (sigmoid + e_score_correction_bias with
group limit; weights from the plain sigmoid, renormalised, times routed_scaling_factor). In transformers 4.x, the
`nn.Linear` gate of a `*SparseMoeBlock` (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral), whose block takes top-k of the
softmax itself: its choice is read by the block's own rule from the gate's logits, and replayed by masking the
logits of the experts not replayed to -inf: the block then takes R3's weights (up to float32 rounding: a softmax over
the k experts rather than one over all, renormalised) where it renormalises the top-k weights, and it is refused where
it does not. Any other MoE: `Routers`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError

if TYPE_CHECKING:
    import torch
    from torch import nn

#: The kind of the rows holding a router's choice (see numbers.routing for the metrics).
ROUTING_KIND = "routing"

#: transformers' router modules (transformers >= 5 made routers modules of their own).
_TRANSFORMERS_ROUTER = re.compile(r".*Top[kK]Router")
#: Softmax routers whose replay rule is known: weights = softmax(logits)[chosen], renormalised when norm_topk_prob
#: (Mixtral has no such attribute and always renormalises).
_SOFTMAX_ROUTERS = frozenset({"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter"})
#: Sigmoid routers with a bias correction and a group limit (DeepSeek-V3's rule).
_SIGMOID_ROUTERS = frozenset({"DeepseekV3TopkRouter"})
#: transformers 4.x MoE blocks whose `gate` is an nn.Linear and whose forward takes the softmax's top-k itself.
_LINEAR_GATE_BLOCKS = frozenset(
    {"Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "MixtralSparseMoeBlock"}
)

#: What `Routers.read` returns: (top-k indices, weights) or (top-k indices, weights, scores top-k was taken over).
Choice = tuple[Any, ...]


@dataclass(frozen=True)
class Routers:
    """How to find and read the routers of a mixture-of-experts model the plugin does not know.

    modules: full-match regexes of the router modules' names (one string is one regex).
    read: `(module, output) -> (indices, weights)` or `(indices, weights, scores)`: the router's top-k expert indices
        and routing weights per token, (tokens, k) each, and optionally the (tokens, experts) scores top-k was taken
        over (for the margins; without them the margin metrics are undefined).
    replay: `(module, output, indices) -> output`: the router's output had it chosen `indices` (tokens, k) instead,
        its weights computed from its own scores at those experts; None: the variants cannot replay routing.
    experts: the number of experts (for the load shift); None: the largest index seen plus one.
    """

    modules: str | Sequence[str]
    read: Callable[[Any, Any], Choice]
    replay: Callable[[Any, Any, Any], Any] | None = None
    experts: int | None = None

    def __post_init__(self) -> None:
        modules: object = self.modules
        patterns = [modules] if isinstance(modules, str) else list(modules) if isinstance(modules, list | tuple) else []
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise ConfigurationError("Routers(modules=...): give a regex or a list of regexes of router module names")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ConfigurationError(f"Routers(modules=...): {pattern!r} is not a valid regex ({error})") from None
        object.__setattr__(self, "modules", tuple(patterns))
        if not callable(self.read):
            raise ConfigurationError("Routers(read=...) must be a callable (module, output) -> (indices, weights)")
        if self.replay is not None and not callable(self.replay):
            raise ConfigurationError("Routers(replay=...) must be a callable (module, output, indices) -> output")
        if self.experts is not None and (isinstance(self.experts, bool) or not isinstance(self.experts, int)):
            raise ConfigurationError(f"Routers(experts=...) must be an int, got {self.experts!r}")
        if self.experts is not None and self.experts < 1:
            raise ConfigurationError(
                f"Routers(experts=...) must be the number of experts, at least 1 (got {self.experts}); or None to "
                "take the largest index seen plus one"
            )


@dataclass(frozen=True)
class RouterChoice:
    """One router call's choice: indices and weights (tokens, k), margins (tokens,) (NaN: unknown)."""

    indices: torch.Tensor
    weights: torch.Tensor
    margins: torch.Tensor


class Router:
    """A router of a model: reads its output, and builds the output of another choice (replay)."""

    def __init__(self, name: str, module: nn.Module, spec: Routers | None, block: nn.Module | None = None) -> None:
        self.name = name
        self.module = module
        self.spec = spec
        #: transformers 4.x: the MoE block whose nn.Linear gate this is (it takes top-k itself); None otherwise.
        self.block = block
        self.kind = type(module).__name__ if block is None else f"{type(block).__name__}.gate"
        counted = module if block is None else block
        self.experts: int | None = spec.experts if spec is not None else getattr(counted, "num_experts", None)

    def read(self, output: Any) -> RouterChoice:
        """The choice in `output`, or a ConfigurationError naming the router."""
        import torch

        if self.spec is not None:
            try:
                values = tuple(self.spec.read(self.module, output))
            except Exception as error:
                raise ConfigurationError(
                    f"router {self.name!r}: Routers.read raised {type(error).__name__}: {error}"
                ) from error
            if len(values) not in (2, 3):
                raise ConfigurationError(
                    f"router {self.name!r}: Routers.read must return (indices, weights) or (indices, weights, scores), "
                    f"got {len(values)} values"
                )
            indices, weights, scores = values[0], values[1], values[2] if len(values) == 3 else None
        elif self.block is not None:
            indices, weights, scores = self._linear_gate_choice(output)
        else:
            if not (
                isinstance(output, tuple)
                and len(output) >= 3
                and all(isinstance(value, torch.Tensor) for value in output[:3])
                and not output[2].is_floating_point()
            ):
                raise ConfigurationError(
                    f"router {self.name!r} ({self.kind}) does not return (router_logits, top_k_weights, top_k_index) "
                    "as transformers >= 5 routers do; name its routers with "
                    "routers=pytest_precision.Routers(modules=..., read=...), or pass routers=False"
                )
            scores, weights, indices = output[0], output[1], output[2]
            if self.kind in _SIGMOID_ROUTERS:
                scores = scores.float().sigmoid() + self.module.e_score_correction_bias
        indices, weights, scores = self._checked_shapes(indices, weights, scores)
        if self.spec is not None:  # a user's read: its numbers are checked too (transformers' come from top-k)
            limit = self.experts if self.experts is not None or scores is None else scores.shape[-1]
            margins = checked_margins(f"router {self.name!r}", indices, scores, limit)
        elif scores is None:
            margins = torch.full((indices.shape[0],), float("nan"), dtype=torch.float64, device=indices.device)
        else:
            margins = choice_margins(scores, indices)
        return RouterChoice(indices, weights, margins)

    def _checked_shapes(
        self, indices: object, weights: object, scores: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """indices and weights as (tokens, k), scores as (tokens, experts), or a ConfigurationError naming the router
        and what is wrong. Shapes only: no host sync."""
        import torch

        if not (isinstance(indices, torch.Tensor) and isinstance(weights, torch.Tensor)):
            raise ConfigurationError(f"router {self.name!r}: its indices and weights must be tensors")
        if indices.dim() == 0 or indices.shape[-1] == 0:
            raise ConfigurationError(
                f"router {self.name!r}: its indices must be (tokens, k) with k >= 1, got shape {tuple(indices.shape)}"
            )
        k = indices.shape[-1]
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ConfigurationError(f"router {self.name!r}: its indices must be integers, got {indices.dtype}")
        if not weights.is_floating_point() or weights.shape != indices.shape:
            raise ConfigurationError(
                f"router {self.name!r}: expected integer indices and float weights of one shape (tokens, k), got "
                f"{indices.dtype} {tuple(indices.shape)} and {weights.dtype} {tuple(weights.shape)}"
            )
        indices, weights = indices.reshape(-1, k), weights.reshape(-1, k)
        tokens = indices.shape[0]
        if self.experts is not None and k > self.experts:
            raise ConfigurationError(
                f"router {self.name!r} chooses k={k} experts per token but has {self.experts} experts "
                f"(Routers(experts=...) or its num_experts); give the router's true expert count"
            )
        if scores is None:
            return indices, weights, None
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() == 0:
            raise ConfigurationError(
                f"router {self.name!r}: its scores must be a float tensor (tokens, experts), got "
                f"{type(scores).__name__ if not isinstance(scores, torch.Tensor) else scores.dtype}"
            )
        # (tokens, experts): the last dim is the experts. A transposed (experts, tokens) tensor of the same size
        # would reshape silently into wrong rows; its last dim is the token count instead.
        experts = scores.shape[-1]
        if scores.numel() != tokens * experts or (self.experts is not None and experts != self.experts):
            expected = f"({tokens}, {self.experts if self.experts is not None else 'experts'})"
            raise ConfigurationError(
                f"router {self.name!r}: its scores have shape {tuple(scores.shape)}, expected {expected}: one row per "
                f"token of its indices {tuple(indices.shape)}, the experts last"
                + (f" (Routers(experts={self.experts}))" if self.spec is not None and self.experts is not None else "")
            )
        if k > experts:
            raise ConfigurationError(
                f"router {self.name!r} chooses k={k} experts per token from scores over {experts} experts"
            )
        return indices, weights, scores.reshape(tokens, experts)

    @property
    def replay_refusal(self) -> str | None:
        """Why this router cannot replay another run's choice (None: it can)."""
        if self.block is not None:
            if self.renormalises:
                return None
            return (
                f"{self.kind} (transformers 4.x) takes top-k of a softmax over all experts without renormalising "
                "(norm_topk_prob=False): masking the other experts' logits would change the replayed weights; replay "
                "it with transformers >= 5, whose routers are modules"
            )
        if self.kind in _SOFTMAX_ROUTERS or self.kind in _SIGMOID_ROUTERS:
            return None
        if self.spec is not None and self.spec.replay is not None:
            return None
        return (
            f"the replay rule of {self.kind} is not known (known: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3); "
            "pass routers=pytest_precision.Routers(modules=..., read=..., replay=...)"
        )

    @property
    def renormalises(self) -> bool:
        """Whether the router renormalises its top-k weights (Mixtral has no norm_topk_prob: it always does)."""
        holder = self.module if self.block is None else self.block
        return bool(getattr(holder, "norm_topk_prob", True))

    def _linear_gate_choice(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The choice a transformers 4.x SparseMoeBlock makes from its gate's logits (tokens, experts), by its rule:
        top-k of the float softmax, renormalised when the block does, cast back to the logits' dtype."""
        import torch

        assert self.block is not None
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_k: int = getattr(self.block, "top_k")  # noqa: B009  (an int attribute nn.Module's typing cannot see)
        weights, indices = torch.topk(probabilities, top_k, dim=-1)
        if self.renormalises:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return indices, weights.to(logits.dtype), logits

    def replayed(self, output: Any, indices: torch.Tensor) -> Any:
        """`output` had the router chosen `indices` (tokens, k): the weights come from its own scores there."""
        import torch

        if self.spec is not None:
            assert self.spec.replay is not None
            try:
                return self.spec.replay(self.module, output, indices)
            except Exception as error:  # the user's callable: blamed on it, not on the model's inputs
                raise ConfigurationError(
                    f"router {self.name!r}: Routers.replay raised {type(error).__name__}: {error}"
                ) from error
        if self.block is not None:  # the block's softmax over the replayed experts only: R3's renormalised weights
            flat = output.reshape(indices.shape[0], -1)
            kept = torch.zeros_like(flat, dtype=torch.bool).scatter(1, indices, True)
            return flat.masked_fill(~kept, float("-inf")).reshape(output.shape)
        logits, weights = output[0], output[1]
        flat = logits.reshape(indices.shape[0], -1)
        if self.kind in _SIGMOID_ROUTERS:
            chosen = flat.float().sigmoid().gather(1, indices)
            if self.module.norm_topk_prob:
                chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
            chosen = chosen * self.module.routed_scaling_factor
        else:
            chosen = torch.softmax(flat, dim=-1, dtype=torch.float).gather(1, indices)
            if getattr(self.module, "norm_topk_prob", True):
                chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return (logits, chosen.to(weights.dtype), indices.to(output[2].dtype), *output[3:])


#: A margin below -MARGIN_SLACK x the token's largest finite |score| says the indices are not the top-k of the
#: scores (scores of other tokens, transposed, or not those top-k was taken over); above it, a top-k taken over a
#: monotone function of the scores (a float32 softmax of them) can still rank two nearly equal scores the other way.
MARGIN_SLACK = 1e-3


def checked_margins(who: str, indices: torch.Tensor, scores: torch.Tensor | None, experts: int | None) -> torch.Tensor:
    """The margins (tokens,) of a choice read by a user's callable (NaN without scores), after checking, in one host
    sync, that every index is an expert (0 <= index < experts; experts None: only >= 0), no token names an expert
    twice, and the indices are the top-k of the scores (no margin below -MARGIN_SLACK x the token's scale).
    A ConfigurationError names `who`, the token and what is wrong."""
    import torch

    tokens = indices.shape[0]
    upper = experts if experts is not None else torch.iinfo(torch.int64).max
    outside = (indices < 0) | (indices >= upper)
    ordered = indices.sort(dim=-1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)
    flags = [outside.any(dim=-1), repeated]
    if scores is None:
        margins = torch.full((tokens,), float("nan"), dtype=torch.float64, device=indices.device)
    else:
        # Clamped, so that an index out of range cannot fault the gather (a device-side assert on CUDA) before it
        # is reported; where every index is in range, clamping changes nothing.
        margins = choice_margins(scores, indices.clamp(0, scores.shape[-1] - 1))
        wide = scores.detach().to(torch.float64)
        scale = torch.where(torch.isfinite(wide), wide.abs(), 0.0).amax(dim=-1)
        flags.append(margins < -MARGIN_SLACK * scale)
    bad = torch.stack([flag.any() for flag in flags]).tolist()  # the one host sync
    if not any(bad):
        return margins
    if bad[0]:
        token = int(outside.any(dim=-1).nonzero()[0, 0])
        allowed = f"0 to {experts - 1}" if experts is not None else ">= 0"
        raise ConfigurationError(
            f"{who}: token {token} of {tokens} names expert(s) {indices[token].tolist()}; an expert index is "
            f"{allowed} ({experts if experts is not None else 'unknown'} experts: Routers(experts=...) or the scores' "
            "last dim); check what read returns, and the expert count"
        )
    if bad[1]:
        token = int(repeated.nonzero()[0, 0])
        raise ConfigurationError(
            f"{who}: token {token} of {tokens} names an expert twice ({indices[token].tolist()}); read must return "
            "the k distinct experts top-k chose"
        )
    assert scores is not None
    token = int(flags[2].nonzero()[0, 0])
    row = scores[token].detach().to(torch.float64)
    chosen = indices[token].tolist()
    other = int(row.scatter(0, indices[token], float("-inf")).argmax())
    raise ConfigurationError(
        f"{who}: its scores disagree with its indices: token {token} chose experts {chosen} (lowest score "
        f"{float(row[indices[token]].min()):.6g}) over expert {other} (score {float(row[other]):.6g}); read must "
        "return the (tokens, experts) scores top-k was taken over, in that order (not transposed; a group-limited "
        "router: the experts of excluded groups at -inf)"
    )


def choice_margins(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per token, the lowest score among the chosen experts minus the highest among the others (float64)."""
    import torch

    scores = scores.to(torch.float64)
    chosen = scores.gather(1, indices)
    others = scores.scatter(1, indices, float("-inf"))
    return chosen.min(dim=-1).values - others.max(dim=-1).values


def find_routers(model: nn.Module, spec: Routers | bool | None) -> dict[str, Router]:
    """The model's routers by module name: those `spec` names (a Routers), transformers' routers (None: found
    automatically), or none (False)."""
    if spec is False:
        return {}
    if isinstance(spec, Routers):
        named = {
            name: Router(name, module, spec)
            for name, module in model.named_modules()
            if name and any(re.fullmatch(pattern, name) for pattern in spec.modules)
        }
        if not named:
            names = [name for name, _ in model.named_modules() if name]
            raise ConfigurationError(
                f"routers: Routers(modules={list(spec.modules)!r}) matches no module of {type(model).__name__} "
                f"(full match on names from named_modules(), e.g. {', '.join(names[:6])})"
            )
        return named
    from torch import nn

    found: dict[str, Router] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if name and _TRANSFORMERS_ROUTER.fullmatch(type(module).__name__) and hasattr(module, "top_k"):
            found[name] = Router(name, module, None)
        parent = modules.get(name.rpartition(".")[0]) if name.endswith(".gate") else None
        if (
            isinstance(module, nn.Linear)
            and parent is not None
            and type(parent).__name__ in _LINEAR_GATE_BLOCKS
            and hasattr(parent, "top_k")
        ):
            found[name] = Router(name, module, None, block=parent)
    return found


def checked_routers(value: object) -> Routers | bool | None:
    """compare(routers=...): None (found automatically), False (none), or a Routers."""
    if value is None or value is False or isinstance(value, Routers):
        return value  # type: ignore[return-value]
    raise ConfigurationError(
        f"routers must be None (transformers' routers, found automatically), False (no routing rows) or "
        f"pytest_precision.Routers(modules=..., read=...), got {value!r}"
    )


def packed(choice: RouterChoice, grid: tuple[int, int] | None) -> torch.Tensor:
    """The choice as the (rows, positions, 2k + 1) float64 tensor streamed as a routing row; (1, tokens, 2k + 1)
    when the router's tokens do not form the call's (rows, positions) grid."""
    import torch

    values = torch.cat(
        [choice.indices.to(torch.float64), choice.weights.detach().to(torch.float64), choice.margins[:, None]], dim=-1
    )
    tokens = values.shape[0]
    rows, length = grid if grid is not None and grid[0] * grid[1] == tokens else (1, tokens)
    return values.reshape(rows, length, -1)


def replay_indices(pack: torch.Tensor, tokens: int) -> torch.Tensor:
    """The indices (tokens, k) of a routing tensor (rows, positions, 2k + 1) to replay in a call of `tokens` tokens."""
    import torch

    k = (pack.shape[-1] - 1) // 2
    if pack.shape[0] * pack.shape[1] != tokens:
        raise ConfigurationError(
            f"routing replay: the recorded routing covers {pack.shape[0] * pack.shape[1]} tokens, this call routes "
            f"{tokens}; replay needs the same tokens in one full forward"
        )
    return pack[..., :k].reshape(tokens, k).to(torch.int64)


def routing_grid(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, int] | None:
    """(rows, positions) of a module call: the leading dims of its first 3-D floating tensor argument."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 3:
            return int(value.shape[0]), int(value.shape[1])
    return None
