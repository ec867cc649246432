"""The plan command's models: Hugging Face presets and configs built on the meta device (no weights,
no downloads), their task, positions, and rows per step counted by a dummy forward and backward.

Part of `dad_integrations.plan`, which re-exports every name.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch

from dad_integrations.capture.assign import build_plan
from dad_integrations.config import DADConfig
from dad_integrations.routing.planner import RowCounts, count_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype

PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "bert-base", "llama-7b-geometry", "llama-3-8b-geometry",
           "llama-small", "vit-tiny", "vit-base", "whisper-tiny", "whisper-base")


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
    if name == "llama-3-8b-geometry":  # grouped-query attention: k and v project to 8 heads (1024 x 4096)
        return tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                              max_position_embeddings=8192)
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


def forward_rows(model: torch.nn.Module, config, *, batch: int, decoder_tokens: int = 128) -> RowCounts:
    """`count_rows` for a dummy batch (`dummy_batch`) of ``batch`` examples per rank, on a plan
    built for it (which parameters are units does not depend on the mode); hooks removed after."""
    plan = build_plan(model, DADConfig())
    try:
        return count_rows(model, plan, dummy_batch(model, config, batch, decoder_tokens))
    finally:
        for c in plan.captures:
            c.remove()
