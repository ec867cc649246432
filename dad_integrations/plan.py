"""Plan before launching: per layer, the route dAD takes in steady state and the bytes it sends.

    python -m dad_integrations.plan --model gpt2-medium --sites 64 --tokens-per-rank 4096 --rank 4

    python -m dad_integrations.plan --model vit-base --sites 16 --batch-per-rank 32 --rank 4

``--model`` is a preset (see `PRESETS`) or a local Hugging Face ``config.json`` (or its folder).
The model is built on the meta device (no weights, no downloads); the units, routes and bytes come
from the synchroniser's own plan (`units.build_plan`), router (`router.route`) and cost model
(`costs`), beside dense all-reduce and PyTorch's PowerSGD hook at the same rank. Each layer shows
its kind: the `layers` registry's kind that captures it (``linear``, ``conv1d``, ``embedding``,
``conv``, ...), ``floor`` for a matrix no kind captures (PowerSGD's coverage floor: dense or the
rank routes from its dense gradient), and ``dense`` for the parameters outside the units.

Rows per step and rank, two ways:

- Text models (``--tokens-per-rank``), by formula: every captured call sees ``tokens_per_rank``
  rows, except position embeddings, which Hugging Face looks up once for ``(1, seq)`` ids (``seq``
  = the tokens, at most the model's positions).
- Vision and speech models (``--batch-per-rank``: images or audio clips), by counting: one forward
  and backward of a dummy batch on the meta device (shapes only, no arithmetic) with the plan's
  captures enabled, each use's rows summed over its calls. A convolution's rows are images x
  output positions, a ViT's linear layers see images x (patches + 1): the count needs no formula
  per architecture, only the kinds' own captures.

Figures are bytes one rank sends per step, after the first (checked) step.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .aggregator import ring_allreduce_bytes
from .config import DADConfig
from .costs import powersgd_bytes, reduce_scatter_bytes, size_exchange_bytes
from .router import UnitShape, route, sharded_needs_counts, unit_estimates
from .units import build_plan

POSITION_EMBEDDINGS = ("wpe", "position_embeddings")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class UnitRow:
    """One factor unit in steady state. Bytes are what one rank sends per step; ``dad`` includes
    the unit's share of the dense buckets (its dense numel)."""

    name: str
    shape: Tuple[int, int]
    rows: List[int]               # rows per use
    route: str
    exchange_sizes: bool
    dad: float
    allreduce: float
    powersgd: Optional[float]
    dense_numel: int = 0
    dense_items: int = 0
    kind: str = ""                # the layer kind (`unit_kind`)


@dataclass
class StepPlan:
    """A steady-state step: the units' rows, the dense parameters' share, and the totals."""

    units: List[UnitRow]
    dense_params: int             # parameters outside the units (plan.dense)
    dense_param_numel: int
    dense_dad: float              # plan.dense's share of the dense buckets
    dense_allreduce: float
    dense_powersgd: Optional[float]
    dense_numel: int              # all of the dense buckets: plan.dense, dense units, rank/dense biases
    dense_items: int
    total: float                  # dAD, as `last_step_report()` accounts it
    allreduce: float
    powersgd: Optional[float]
    counts: Dict[str, int] = field(default_factory=dict)   # units per route


RowCounts = Dict[str, List[int]]   # unit name -> rows per use, one step on one rank


def use_rows(capture, tokens: int, positions: int) -> int:
    """Rows one step gives a captured layer: ``positions`` for position embeddings, else ``tokens``."""
    return positions if capture.name.endswith(POSITION_EMBEDDINGS) else tokens


def unit_rows(u, tokens: int, positions: int, counted: Optional[RowCounts]) -> List[int]:
    """Rows per use of unit ``u``: counted by a dummy forward (`count_rows`) where given, else by
    the text formula (`use_rows`)."""
    if counted is not None:
        return list(counted.get(u.name, [0] * len(u.uses)))
    return [use_rows(c, tokens, positions) for c in u.uses]


def unit_kind(u) -> str:
    """The layer kind of a unit: the registry kinds of the modules that run its uses (``+``-joined
    for a weight used by two kinds, GPT-2's tied ``wte``/``lm_head``: ``embedding+linear``), or
    ``floor`` for a unit without uses (no kind captures it: its dense gradient takes dense or the
    rank routes, as PowerSGD's hook compresses every matrix)."""
    from .layers import layer_kind

    if not u.uses:
        return "floor"
    names: List[str] = []
    for c in u.uses:
        name = layer_kind(c.module) or c.kind  # (a kind's use always has a registered module)
        if name not in names:
            names.append(name)
    return "+".join(names)


def steady_state(plan, *, tokens: int, positions: int, world_size: int, mode: str, rank: Optional[int],
                 rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
                 powersgd_rank: Optional[int] = None, timing=None, rows: Optional[RowCounts] = None) -> StepPlan:
    """Bytes one rank sends per unit in a steady-state step of ``mode`` (the router's decision from
    the counts of the unit's last size exchange), with ``tokens`` rows per captured call, or the
    counted ``rows`` per use (`count_rows`) where given.

    Size exchanges count where the route needs agreed rows; biases of rank-r and dense units go to
    the dense buckets, as the synchroniser sends them (a step where every rank has every gradient
    needs no flags: `codecs.dense`). ``powersgd_rank``
    (default ``rank``) adds PyTorch's PowerSGD hook per parameter; None when neither is set.
    With a ``timing`` (`timing.StepTiming`), routes are chosen by predicted time (objective
    ``"time"``), else by bytes.
    """
    s, item = world_size, dtype.itemsize
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route,
                       objective="time" if timing is not None else "bytes")
    psgd_rank = powersgd_rank if powersgd_rank is not None else rank

    def psgd(params) -> Optional[float]:
        if not psgd_rank:
            return None
        return sum(powersgd_bytes(tuple(p.shape), psgd_rank, s, item)[0] for p in params)

    counts = {"exact": 0, "rank": 0, "rank_allreduce": 0, "dense": 0}
    units: List[UnitRow] = []
    sent = 0.0  # everything but the dense buckets
    dense_param_numel = sum(p.numel() for _, p in plan.dense)
    dense_numel, dense_items = dense_param_numel, len(plan.dense)
    for u in plan.units:
        m, n = u.shape  # the matrix view: a convolution's (out, in x kernel)
        bias_numel = u.bias_numel
        shape = UnitShape(tuple(u.kinds), (m, n), bias_numel, dtype, u.blocks)
        use = unit_rows(u, tokens, positions, rows)
        rows_by_rank = [use] * s
        decision = route(config, shape, world_size=s, wire_dtype=dtype, last_rows=rows_by_rank, timing=timing)
        exchange = decision.exchange_sizes
        if decision.representation is None:  # decided on this step's counts, the same in steady state
            decision = route(config, shape, world_size=s, wire_dtype=dtype, rows_by_rank=rows_by_rank, timing=timing)
        rep = decision.representation
        est = unit_estimates(config, shape, rows_by_rank, s, dtype)
        counts[rep] += 1
        own = size_exchange_bytes(len(u.uses), s) if exchange else 0.0
        d_numel = d_items = 0
        if rep == "exact":
            own += est["exact"]
        elif rep in ("rank", "rank_allreduce"):
            own += est[rep] - ring_allreduce_bytes(bias_numel * item, s)
            d_numel, d_items = bias_numel, len(u.biases)
        else:
            d_numel, d_items = m * n + bias_numel, 1 + len(u.biases)
        sent += own
        dense_numel += d_numel
        dense_items += d_items
        params = [u.param] + [b.param for b in u.biases]
        units.append(UnitRow(u.name, (m, n), use, rep, exchange,
                             own + ring_allreduce_bytes(d_numel * item, s),
                             ring_allreduce_bytes((m * n + bias_numel) * item, s), psgd(params),
                             d_numel, d_items, unit_kind(u)))
    total = sent
    if dense_items:
        total += ring_allreduce_bytes(dense_numel * item, s)
    dense_params = [p for _, p in plan.dense]
    dense_psgd = psgd(dense_params)
    unit_psgd = [r.powersgd for r in units]
    return StepPlan(
        units=units, dense_params=len(plan.dense), dense_param_numel=dense_param_numel,
        dense_dad=ring_allreduce_bytes(dense_param_numel * item, s),
        dense_allreduce=ring_allreduce_bytes(dense_param_numel * item, s), dense_powersgd=dense_psgd,
        dense_numel=dense_numel, dense_items=dense_items, total=total,
        allreduce=ring_allreduce_bytes((dense_param_numel + sum(m * n for m, n in (r.shape for r in units))
                                        + sum(u.bias_numel for u in plan.units)) * item, s),
        powersgd=None if dense_psgd is None else dense_psgd + sum(unit_psgd), counts=counts)


# -- sharded (FSDP2) ------------------------------------------------------------------------------------
@dataclass
class ShardedUnitRow:
    """One factor unit under FSDP2 in steady state: bytes one rank sends per step by dAD's route
    (its row-count exchange included) and by FSDP2's reduce-scatter, weight and biases together."""

    name: str
    shape: Tuple[int, int]
    rows: List[int]
    route: str
    dad: float
    reduce_scatter: float
    kind: str = ""


@dataclass
class ShardedStepPlan:
    """A steady-state sharded step: the units, the parameters outside them (always reduce-scattered),
    and the totals (``total``: dAD, as `ShardedStepReport.totals["sent_bytes"]` accounts it)."""

    units: List[ShardedUnitRow]
    dense_params: int
    dense_reduce_scatter: float
    total: float
    reduce_scatter: float
    counts: Dict[str, int] = field(default_factory=dict)


def sharded_steady_state(plan, *, tokens: int, positions: int, world_size: int, mode: str,
                         rank: Optional[int], rank_route: str = DADConfig.rank_route,
                         dtype: torch.dtype = torch.float32, rows: Optional[RowCounts] = None) -> ShardedStepPlan:
    """Bytes one rank sends per unit in a steady-state FSDP2 step (`fsdp.enable_dad_fsdp`): every
    unit's rows are exchanged each backward (`codecs.sharded_exact.exchange_row_counts`; not in
    mode ``"rank"``, `router.sharded_needs_counts`), the router decides with ``sharded=True`` on
    those counts, and the route's estimate is what the unit sends; parameters outside the units, and units routed dense, go through FSDP2's
    reduce-scatter (`costs.reduce_scatter_bytes`, in ``dtype``)."""
    s, item = world_size, dtype.itemsize
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route)
    exchanges_counts = sharded_needs_counts(config, step=config.lossless_steps)  # a steady-state step
    counts: Dict[str, int] = {}
    units: List[ShardedUnitRow] = []
    for u in plan.units:
        m, n = u.shape
        shape = UnitShape(tuple(u.kinds), (m, n), u.bias_numel, dtype, u.blocks)
        use = unit_rows(u, tokens, positions, rows)
        rows_by_rank = [use] * s
        rep = route(config, shape, world_size=s, wire_dtype=dtype, rows_by_rank=rows_by_rank,
                    sharded=True).representation
        est = unit_estimates(config, shape, rows_by_rank, s, dtype, sharded=True)
        counts[rep] = counts.get(rep, 0) + 1
        baseline = reduce_scatter_bytes((m, n), s, item) + sum(reduce_scatter_bytes(tuple(b.param.shape), s, item)
                                                               for b in u.biases)
        counts_exchange = (s - 1) * 8.0 * len(u.uses) if exchanges_counts else 0.0  # whatever the route
        dad = (baseline if rep == "dense" else est[rep]) + counts_exchange
        units.append(ShardedUnitRow(u.name, (m, n), use, rep, dad, baseline, unit_kind(u)))
    dense = sum(reduce_scatter_bytes(tuple(p.shape), s, item) for _, p in plan.dense)
    return ShardedStepPlan(units=units, dense_params=len(plan.dense), dense_reduce_scatter=dense,
                           total=dense + sum(r.dad for r in units),
                           reduce_scatter=dense + sum(r.reduce_scatter for r in units), counts=counts)


# -- Hugging Face models on the meta device ----------------------------------------------------------
PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "bert-base", "llama-7b-geometry", "llama-small",
           "vit-tiny", "vit-base", "whisper-tiny", "whisper-base")


def preset_config(name: str):
    """The Hugging Face config of a named preset (geometry only: nothing is downloaded)."""
    import transformers as tf

    if name in ("gpt2", "gpt2-medium", "gpt2-large"):
        d, layers, heads = {"gpt2": (768, 12, 12), "gpt2-medium": (1024, 24, 16), "gpt2-large": (1280, 36, 20)}[name]
        return tf.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=d, n_layer=layers, n_head=heads)
    if name == "bert-base":
        return tf.BertConfig()  # bert-base-uncased
    if name == "llama-7b-geometry":
        return tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                              num_attention_heads=32, vocab_size=32000)
    if name == "llama-small":
        return tf.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                              num_attention_heads=8, vocab_size=32000)
    if name in ("vit-tiny", "vit-base"):  # ViT-Ti/16 and ViT-B/16 at 224 x 224, ImageNet's 1000 classes
        d, heads = {"vit-tiny": (192, 3), "vit-base": (768, 12)}[name]
        return tf.ViTConfig(hidden_size=d, num_hidden_layers=12, num_attention_heads=heads, intermediate_size=4 * d,
                            image_size=224, patch_size=16, num_labels=1000,
                            architectures=["ViTForImageClassification"])
    if name in ("whisper-tiny", "whisper-base"):  # openai/whisper-tiny and -base geometry
        d, layers, heads = {"whisper-tiny": (384, 4, 6), "whisper-base": (512, 6, 8)}[name]
        return tf.WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=d, encoder_layers=layers,
                                decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                                encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d,
                                architectures=["WhisperForConditionalGeneration"])
    raise ValueError(f"unknown model preset {name!r}; presets: {PRESETS}, or a path to a config.json")


def load_config(model: str):
    """A preset's config, or a local ``config.json`` (a file or its folder), read offline."""
    if model in PRESETS:
        return preset_config(model)
    path = Path(model)
    if not path.exists():
        raise ValueError(f"--model {model!r}: not a preset {PRESETS} and no such file")
    from transformers import AutoConfig

    if path.is_dir():
        path = path / "config.json"
    if "model_type" not in json.loads(path.read_text()):
        raise ValueError(f"{path}: no 'model_type' key")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def model_task(config) -> str:
    """What ``config`` builds: ``"image"`` (image classification: ViT, ResNet, ...), ``"speech"``
    (speech-to-text encoder-decoder: Whisper) or ``"text"`` (causal or masked LM, the rest).
    By the config's ``architectures`` where they say, else by which auto class maps its type."""
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSpeechSeq2Seq

    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForImageClassification") for a in archs):
        return "image"
    if any(a.endswith("ForConditionalGeneration") for a in archs) and _maps(AutoModelForSpeechSeq2Seq, config):
        return "speech"
    if archs or _maps(AutoModelForCausalLM, config):
        return "text"
    if _maps(AutoModelForImageClassification, config):
        return "image"
    if _maps(AutoModelForSpeechSeq2Seq, config):
        return "speech"
    return "text"


def _maps(auto, config) -> bool:
    try:
        return type(config) in auto._model_mapping
    except Exception:  # a mapping entry whose module fails to import
        return False


def build_meta_model(config) -> torch.nn.Module:
    """The model of ``config`` on the meta device: an image classifier or a speech-to-text model
    where `model_task` says so; else a masked LM where its architectures say so, else a causal LM
    (falling back to a masked LM for encoder-only types)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForMaskedLM
    from transformers import AutoModelForSpeechSeq2Seq

    task = model_task(config)
    if task != "text":
        auto = AutoModelForImageClassification if task == "image" else AutoModelForSpeechSeq2Seq
        with torch.device("meta"):
            return auto.from_config(config)
    archs = getattr(config, "architectures", None) or []
    masked = any("MaskedLM" in a for a in archs) or config.model_type == "bert"
    order = (AutoModelForMaskedLM, AutoModelForCausalLM) if masked else (AutoModelForCausalLM, AutoModelForMaskedLM)
    with torch.device("meta"):
        try:
            return order[0].from_config(config)
        except ValueError:
            return order[1].from_config(config)


def max_positions(config) -> Optional[int]:
    """Position-embedding rows of ``config`` (None where it has no such table)."""
    for key in ("n_positions", "max_position_embeddings"):
        v = getattr(config, key, None)
        if v:
            return int(v)
    return None


def dummy_batch(model: torch.nn.Module, config, batch: int, decoder_tokens: int) -> Dict[str, torch.Tensor]:
    """Keyword inputs of one step of ``batch`` examples per rank, on the model's device: images
    of the config's size, or Whisper's log-mel features (``2 x max_source_positions`` frames, the
    30 s its encoder requires) with ``decoder_tokens`` decoder tokens per clip."""
    device = next(model.parameters()).device
    name = getattr(model, "main_input_name", "input_ids")
    if name == "pixel_values":
        size = getattr(config, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return {"pixel_values": torch.zeros(batch, getattr(config, "num_channels", 3), h, w, device=device)}
    if name == "input_features" and hasattr(config, "max_source_positions"):
        feats = torch.zeros(batch, config.num_mel_bins, 2 * config.max_source_positions, device=device)
        ids = torch.ones(batch, decoder_tokens, dtype=torch.long, device=device)
        return {"input_features": feats, "decoder_input_ids": ids}
    raise ValueError(f"no dummy batch known for {type(model).__name__} (input {name!r}); "
                     f"give --tokens-per-rank for a text model")


def count_rows(model: torch.nn.Module, plan, inputs: Dict[str, torch.Tensor]) -> RowCounts:
    """Rows per use of every unit of ``plan`` in one step: one forward and backward of ``inputs``
    with the plan's captures enabled, each use's rows summed over its calls (a pair's left block
    has one row per row: output-gradient rows, input rows or token ids, whatever the layout).

    On the meta device nothing is computed; where a capture drops rows by value (an embedding's
    padding rows) the meta tensors count them all: the dummy batch holds no padding.
    """
    out = model(**inputs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    try:  # masks on meta tensors (embedding padding): assume every element is kept
        import torch.fx.experimental._config as fx_config
        keep_all = fx_config.patch(meta_nonzero_assume_all_nonzero=True)
    except (ImportError, AttributeError):  # pragma: no cover - older torch
        import contextlib
        keep_all = contextlib.nullcontext()
    with keep_all:
        logits.float().sum().backward()
    counted = {u.name: [sum(int(pair[0].shape[0]) for pair in c.pairs) for c in u.uses] for u in plan.units}
    for p in model.parameters():
        p.grad = None
    for c in plan.captures:
        c.clear()
    return counted


def forward_rows(model: torch.nn.Module, config, *, batch: int, decoder_tokens: int = 128) -> RowCounts:
    """`count_rows` for a dummy batch (`dummy_batch`) of ``batch`` examples per rank, on a plan
    built for it (which parameters are units does not depend on the mode); hooks removed after."""
    plan = build_plan(model, DADConfig())
    try:
        return count_rows(model, plan, dummy_batch(model, config, batch, decoder_tokens))
    finally:
        for c in plan.captures:
            c.remove()


def plan_model(model: torch.nn.Module, *, sites: int, tokens_per_rank: int, rank: Optional[int],
               mode: str = "auto", rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
               positions: Optional[int] = None, timing=None, rows: Optional[RowCounts] = None) -> StepPlan:
    """`steady_state` for ``model`` (its plan built, its capture hooks removed); by predicted time
    with a ``timing``; with counted ``rows`` (`forward_rows`) instead of the text formula."""
    if mode == "rank" and not rank:
        raise ValueError("--mode rank needs a rank (--rank >= 1)")
    dad_rank = rank if rank and mode != "exact" else None
    plan = build_plan(model, DADConfig(mode=mode, rank=dad_rank, rank_route=rank_route))
    for c in plan.captures:
        c.remove()  # only the plan is needed, not the hooks
    seq = min(tokens_per_rank, positions) if positions else tokens_per_rank
    return steady_state(plan, tokens=tokens_per_rank, positions=seq, world_size=sites, mode=mode,
                        rank=dad_rank, rank_route=rank_route, dtype=dtype, powersgd_rank=rank or None,
                        timing=timing, rows=rows)


# -- output -------------------------------------------------------------------------------------------
def _mb(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 2 ** 20:,.2f}"


def _table(header: str, columns: Sequence[Tuple[str, int]], units: Sequence[Sequence[str]],
           other: Sequence[str], total: Sequence[str], footer: Sequence[str]) -> str:
    """A plan as text: the name column, then ``columns`` (title, width; right-aligned but for the
    kind and the route), one line per factor unit, the other parameters, a rule and the totals."""
    name_w = max([len(u[0]) for u in units] + [len(other[0])])

    def line(cells: Sequence[str]) -> str:
        out = [f"{cells[0]:<{name_w}}"]
        for (title, width), cell in zip(columns, cells[1:]):
            out.append(f"{cell:<{width}}" if title in ("route", "kind") else f"{cell:>{width}}")
        return "  ".join(out)

    head = line(["layer"] + [title for title, _ in columns])
    rule = "-" * len(head)
    return "\n".join([header, "", head, rule] + [line(u) for u in units] + [line(other), rule, line(total), ""]
                     + list(footer))


def _kind_width(units) -> int:
    return max([len(r.kind) for r in units] + [5])


def _rows(rows: Sequence[int]) -> str:
    """Rows per use, ``+``-joined; ``-`` for a unit without uses (its dense gradient is routed)."""
    return "+".join(map(str, rows)) if rows else "-"


def render(step: StepPlan, header: str) -> str:
    """The plan as a text table, one line per factor unit, then the dense parameters and totals."""
    columns = [("kind", _kind_width(step.units)), ("shape", 12), ("rows", 11), ("route", 14), ("dAD MB", 10),
               ("all-reduce MB", 13), ("PowerSGD MB", 11)]
    units = [[r.name, r.kind, "x".join(map(str, r.shape)), _rows(r.rows), r.route, _mb(r.dad), _mb(r.allreduce),
              _mb(r.powersgd)] for r in step.units]
    other = [f"dense parameters ({step.dense_params})", "dense", f"{step.dense_param_numel:,} el", "", "dense",
             _mb(step.dense_dad), _mb(step.dense_allreduce), _mb(step.dense_powersgd)]
    total = ["total", "", "", "", "", _mb(step.total), _mb(step.allreduce), _mb(step.powersgd)]
    c = step.counts
    footer = [f"routes: {c['exact']} exact, {c['rank']} rank (all-gather), "
              f"{c['rank_allreduce']} rank (all-reduce), {c['dense']} dense",
              f"dAD / all-reduce: {step.total / step.allreduce:.4f}"
              + ("" if step.powersgd is None else f"; PowerSGD / all-reduce: {step.powersgd / step.allreduce:.4f}")]
    return _table(header, columns, units, other, total, footer)


def render_sharded(step: ShardedStepPlan, header: str) -> str:
    """The sharded plan as a text table: per factor unit, dAD's route and bytes beside FSDP2's
    reduce-scatter; then the other parameters and the totals."""
    columns = [("kind", _kind_width(step.units)), ("shape", 12), ("rows", 11), ("route", 14), ("dAD MB", 10),
               ("reduce-scatter MB", 17)]
    units = [[r.name, r.kind, "x".join(map(str, r.shape)), _rows(r.rows), r.route, _mb(r.dad),
              _mb(r.reduce_scatter)] for r in step.units]
    other = [f"other parameters ({step.dense_params})", "dense", "", "", "dense", _mb(step.dense_reduce_scatter),
             _mb(step.dense_reduce_scatter)]
    total = ["total", "", "", "", "", _mb(step.total), _mb(step.reduce_scatter)]
    footer = ["routes: " + ", ".join(f"{v} {k}" for k, v in sorted(step.counts.items())),
              f"dAD / reduce-scatter: {step.total / step.reduce_scatter:.4f}"]
    return _table(header, columns, units, other, total, footer)


def plan_sharded_model(model: torch.nn.Module, *, sites: int, tokens_per_rank: int, rank: Optional[int],
                       mode: str = "auto", rank_route: str = DADConfig.rank_route,
                       dtype: torch.dtype = torch.float32, positions: Optional[int] = None,
                       rows: Optional[RowCounts] = None) -> ShardedStepPlan:
    """`sharded_steady_state` for ``model`` (its plan built, its capture hooks removed)."""
    dad_rank = rank if rank and mode != "exact" else None
    plan = build_plan(model, DADConfig(mode=mode, rank=dad_rank, rank_route=rank_route))
    for c in plan.captures:
        c.remove()
    seq = min(tokens_per_rank, positions) if positions else tokens_per_rank
    return sharded_steady_state(plan, tokens=tokens_per_rank, positions=seq, world_size=sites, mode=mode,
                                rank=dad_rank, rank_route=rank_route, dtype=dtype, rows=rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m dad_integrations.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help=f"a preset {PRESETS} or a path to a config.json")
    p.add_argument("--sites", type=int, required=True, help="number of ranks (S)")
    p.add_argument("--tokens-per-rank", type=int, help="text models: tokens per rank per step")
    p.add_argument("--batch-per-rank", type=int,
                   help="vision and speech models: images (or audio clips) per rank per step; rows are "
                        "counted by a forward and backward of such a dummy batch on the meta device")
    p.add_argument("--decoder-tokens", type=int, default=128,
                   help="speech models (Whisper): decoder tokens per clip (default 128)")
    p.add_argument("--rank", type=int, default=4, help="rank of rank-dAD and PowerSGD (0: none)")
    p.add_argument("--mode", choices=("auto", "exact", "rank"), default="auto")
    # the synchroniser's own default, so that the plan shows what a default config does
    p.add_argument("--rank-route", choices=("auto", "allgather", "allreduce"), default=DADConfig.rank_route)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="gradient and wire dtype")
    p.add_argument("--sharded", action="store_true",
                   help="plan for FSDP2 (each rank keeps a shard; the baseline is a reduce-scatter)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--bandwidth", help="a link to predict step time on, e.g. 10gbit, 100mbit (per rank); "
                                       "routes are then chosen by time, as objective 'time' does")
    p.add_argument("--latency-us", type=float, default=0.0, help="the link's latency per collective call")
    p.add_argument("--compute-device", default="cpu",
                   help="where the routes' local compute is measured for the model's weight shapes "
                        "(cpu, cuda, ...), or none to count no compute")
    args = p.parse_args(argv)
    if args.sites < 2 or args.rank < 0 or args.decoder_tokens < 1:
        p.error("need --sites >= 2, --rank >= 0, --decoder-tokens >= 1")
    if (args.tokens_per_rank is not None and args.tokens_per_rank < 1) or (
            args.batch_per_rank is not None and args.batch_per_rank < 1):
        p.error("need --tokens-per-rank >= 1 and --batch-per-rank >= 1")
    if args.mode == "rank" and not args.rank:
        p.error("--mode rank needs a rank (--rank >= 1)")
    try:
        cfg = load_config(args.model)
        task = model_task(cfg)
        model = build_meta_model(cfg)
        rows = None
        if task == "text":
            if args.tokens_per_rank is None or args.batch_per_rank is not None:
                raise ValueError(f"--model {args.model!r} is a text model: give --tokens-per-rank "
                                 f"(not --batch-per-rank)")
        else:
            if args.batch_per_rank is None or args.tokens_per_rank is not None:
                raise ValueError(f"--model {args.model!r} is a {task} model: give --batch-per-rank (its rows "
                                 f"are counted by a forward pass), not --tokens-per-rank")
            rows = forward_rows(model, cfg, batch=args.batch_per_rank, decoder_tokens=args.decoder_tokens)
            args.tokens_per_rank = 0  # (the formula is not used)
        planner = plan_sharded_model if args.sharded else plan_model
        step = planner(model, sites=args.sites, tokens_per_rank=args.tokens_per_rank, rank=args.rank or None,
                       mode=args.mode, rank_route=args.rank_route, dtype=DTYPES[args.dtype],
                       positions=max_positions(cfg), rows=rows)
        timed = None
        if args.bandwidth is not None:
            if args.sharded:
                raise ValueError("--bandwidth: the step-time prediction covers unsharded plans only")
            timed = _time_plan(args, model, cfg, step, rows)
    except ValueError as e:
        p.error(str(e))
    if args.json:
        out = {"model": args.model, "task": task, "sites": args.sites, "tokens_per_rank": args.tokens_per_rank,
               "batch_per_rank": args.batch_per_rank, "sharded": args.sharded, "rank": args.rank, "mode": args.mode,
               "rank_route": args.rank_route, "dtype": args.dtype,
               **asdict(step)}
        if timed is not None:
            out["time"] = asdict(timed[0])
            out["time"]["by_time"] = asdict(timed[1])
        print(json.dumps(out, indent=1))
    else:
        per_rank = (f"{args.tokens_per_rank} tokens per rank" if task == "text" else
                    f"{args.batch_per_rank} {'images' if task == 'image' else 'clips'} per rank (rows counted)")
        header = (f"{args.model}: {args.sites} sites, {per_rank}, mode {args.mode}, "
                  f"rank {args.rank or '-'}, rank route {args.rank_route}, {args.dtype}"
                  f"{', sharded (FSDP2)' if args.sharded else ''}; MB one rank sends per steady-state step")
        print((render_sharded if args.sharded else render)(step, header))
        if timed is not None:
            from .plan_time import render_time
            print()
            print(render_time(timed[0], timed[2], timed[3]))
    return 0


def _time_plan(args, model: torch.nn.Module, cfg, by_bytes: StepPlan, rows: Optional[RowCounts] = None):
    """The plan by predicted time on the stated link: (time plan, the steady state by time, link, note)."""
    from .compute_model import ComputeModel, measure_compute
    from .link import LinkModel, parse_bandwidth
    from .plan_time import time_plan
    from .rows import compute_dtype
    from .timing import StepTiming

    link = LinkModel.uniform(parse_bandwidth(args.bandwidth), args.latency_us * 1e-6)
    rank = args.rank if args.rank and args.mode != "exact" else None
    if args.compute_device == "none":
        compute, note = ComputeModel(), "no compute counted"
    else:
        shapes = {tuple(r.shape) for r in by_bytes.units}
        compute = measure_compute(shapes, rank=rank, world_size=args.sites, iterations=DADConfig.power_iterations,
                                  error_feedback=DADConfig.error_feedback, device=torch.device(args.compute_device),
                                  dtype=compute_dtype(DTYPES[args.dtype]))  # as the codecs compute
        note = f"compute measured on {args.compute_device}"
    timing = StepTiming(link, compute)
    by_time = plan_model(model, sites=args.sites, tokens_per_rank=args.tokens_per_rank, rank=args.rank or None,
                         mode=args.mode, rank_route=args.rank_route, dtype=DTYPES[args.dtype],
                         positions=max_positions(cfg), timing=timing, rows=rows)
    return time_plan(by_time, timing, sites=args.sites, compressed=by_bytes), by_time, link, note


if __name__ == "__main__":
    sys.exit(main())
