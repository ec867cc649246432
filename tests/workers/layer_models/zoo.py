"""The model zoo: five small models that between them have every layer a model has.

Each is built from a config (nothing downloaded) with a deterministic batch of a few examples and
a loss. Between them they hold the weights dAD must cover beyond Linear and Embedding:

| model          | matrices beyond Linear/Embedding                                          |
|----------------|---------------------------------------------------------------------------|
| `zoo_vit`      | Conv2d patchify, raw class token and position embedding, MHA's packed     |
|                | ``in_proj_weight`` and its ``out_proj`` (run by MHA's functional forward) |
| `zoo_cnn`      | Conv2d 3x3 and 1x1 (bias-free, under BatchNorm2d), strided               |
| `zoo_gru`      | a 2-layer ``nn.GRU``'s ``weight_ih_l*`` / ``weight_hh_l*`` (3 gates packed)|
| `zoo_hf_vit`   | Hugging Face ViT: patch Conv2d, class token, position embeddings          |
| `zoo_whisper`  | Whisper: two Conv1d front-end layers, frozen sinusoidal encoder positions,|
|                | learned decoder positions (an Embedding subclass with its own forward),   |
|                | a token embedding tied to the output projection                           |

Kinds that capture convolutions, attention and recurrent layers turn these weights into factor
units; until they do, PowerSGD's coverage floor (`capture.assign.build_plan`) routes them dense or rank
from their dense gradients. The tests (`tests/test_model_zoo.py`) hold under both.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from . import Model

IMAGE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 10
VOCAB, SEQ = 64, 12


class TinyViT(nn.Module):
    """torchvision's ``VisionTransformer`` in small: a Conv2d patchify (kernel = stride = patch),
    a class token and a position embedding as raw parameters, ``nn.TransformerEncoder`` layers
    (``nn.MultiheadAttention`` inside), a final LayerNorm and a Linear head on the class token."""

    def __init__(self, hidden: int = 32, layers: int = 2, heads: int = 2):
        super().__init__()
        self.conv_proj = nn.Conv2d(CHANNELS, hidden, kernel_size=PATCH, stride=PATCH)
        seq = (IMAGE // PATCH) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embedding = nn.Parameter(torch.randn(1, seq, hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=2 * hidden, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        # no nested tensors: every sequence has the same length, and the fast path is inference-only
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(images).flatten(2).transpose(1, 2)         # (N, patches, hidden)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.ln(self.encoder(x))[:, 0])


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the shortcut (a strided 1x1 conv + BN when
    the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class TinyResNet(nn.Module):
    """Stem conv, two residual blocks (the second strided and wider), global average pool, Linear."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(CHANNELS, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.blocks = nn.Sequential(Block(width, width), Block(width, 2 * width, stride=2))
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(images))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class GRULM(nn.Module):
    """A next-token language model: Embedding, a 2-layer ``nn.GRU``, a Linear head."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.rnn = nn.GRU(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


def hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=IMAGE,
        patch_size=PATCH, num_channels=CHANNELS, num_labels=CLASSES, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


MEL_BINS, SOURCE_POSITIONS = 8, 16  # conv2 has stride 2: 2 * SOURCE_POSITIONS input frames


def hf_whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=SOURCE_POSITIONS, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None))


def _images(size: int, g: torch.Generator) -> dict:
    return {"images": torch.randn(size, CHANNELS, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, CLASSES, (size,), generator=g)}


def _tokens(size: int, g: torch.Generator) -> dict:
    return {"ids": torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)}


def _speech(size: int, g: torch.Generator) -> dict:
    return {"input_features": torch.randn(size, MEL_BINS, 2 * SOURCE_POSITIONS, generator=g),
            "labels": torch.randint(3, VOCAB, (size, 8), generator=g)}


def _classify(model: nn.Module, data: dict) -> torch.Tensor:
    return F.cross_entropy(model(data["images"]), data["labels"])


def _next_token(model: nn.Module, data: dict) -> torch.Tensor:
    logits = model(data["ids"][:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), data["ids"][:, 1:].reshape(-1))


def _hf_classify(model: nn.Module, data: dict) -> torch.Tensor:
    return model(pixel_values=data["images"], labels=data["labels"]).loss


def _hf_seq2seq(model: nn.Module, data: dict) -> torch.Tensor:
    # decoder inputs are the labels shifted right behind decoder_start_token_id (the model does it)
    return model(input_features=data["input_features"], labels=data["labels"]).loss


MODELS = {
    "zoo_vit": Model(TinyViT, _images, _classify),
    "zoo_cnn": Model(TinyResNet, _images, _classify),
    "zoo_gru": Model(GRULM, _tokens, _next_token),
    "zoo_hf_vit": Model(hf_vit, _images, _hf_classify),
    "zoo_whisper": Model(hf_whisper, _speech, _hf_seq2seq),
}
