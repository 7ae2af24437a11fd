"""What the analyses run on: a model behind one small interface (LanguageModel), and fixed
batches of real text.

Fresh megatron-core GPTs are built here; checkpoints and HF folders are read by analysis.loading.
Everything runs in one process: on CPU inside the caller's mixln_megatron.cpu.harness() and a
single-rank gloo group, enough for the model sizes the diagnostics are meant for; with CUDA the
megatron models go to the current GPU (untested here). The text batches are fixed by a data seed
independent of the model seed, so every variant sees the same tokens in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from .. import cpu
from ..data.corpus import austen_paragraphs, split_paragraphs
from ..data.preprocess import prepare_austen_dataset
from ..data.tokenizer import load_tokenizer
from ..model.settings import analysis_cache_dir

# Embedding init std of the Mix-LN reference training code (megatron's default: 0.02).
REFERENCE_EMBEDDING_STD = math.sqrt(2.0 / 5.0)


# ----------------------------------------------------------------------------------- single process
def ensure_megatron_cpu(seed: int = 1234) -> None:
    """A one-rank gloo group and megatron's parallel state (TP = PP = 1), once (reused if they exist), and
    the seeds. Without CUDA the caller enters the CPU harness: a library does not patch the process."""
    from megatron.core import parallel_state as ps  # heavy

    if not torch.cuda.is_available() and not cpu.is_enabled():
        raise RuntimeError("megatron-core needs the CPU harness on a machine without CUDA: run this inside "
                           "`with mixln_megatron.cpu.harness(): ...`")
    if not torch.distributed.is_initialized():  # one rank: an in-memory store, no port to bind
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    if torch.distributed.get_world_size() != 1:
        raise RuntimeError("the analysis tools run in a single process (world size 1), not under torchrun")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    from megatron.core import tensor_parallel  # heavy

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ----------------------------------------------------------------------------------- model shapes
@dataclasses.dataclass(frozen=True)
class FreshShape:
    """The shape and initialisation of a fresh LLaMA-shaped GPT the analyses build (RMSNorm, SwiGLU,
    RoPE, no biases, untied embeddings, as the paper). A checkpoint's model shape is convert.shape's
    (ArgsShape / ModelShape, read by convert.inspect); this is only the recipe for a new model."""

    num_layers: int = 12
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default: LLaMA's 8/3 * hidden, rounded up to 16
    vocab_size: int = 4096
    seq_length: int = 128
    num_query_groups: Optional[int] = None
    init_method_std: float = 0.02  # megatron's default (also the std of the embeddings)
    embedding_init_std: Optional[float] = None  # None: init_method_std (megatron's default)
    untie_embeddings: bool = True

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(math.ceil(8 * self.hidden_size / 3 / 16) * 16)

    def describe(self) -> str:
        emb = self.embedding_init_std if self.embedding_init_std is not None else self.init_method_std
        return (f"L={self.num_layers} h={self.hidden_size} heads={self.num_attention_heads} "
                f"ffn={self.ffn} vocab={self.vocab_size} seq={self.seq_length} "
                f"init_std={self.init_method_std:g} emb_std={emb:.4g}")


def megatron_config(shape: FreshShape, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig  # heavy

    cfg = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn, normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        init_method_std=shape.init_method_std, embedding_init_method_std=shape.embedding_init_std,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_activation_fusion=False,
    )
    cfg.update(overrides)
    return TransformerConfig(**cfg)


@contextlib.contextmanager
def _quiet_gpt_deprecation():
    """megatron-core 0.19 logs a deprecation notice for every GPTModel built; noise in sweeps."""
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _to_device(model):
    """On a machine with CUDA (no CPU shim there) the model runs on the current GPU; else CPU."""
    if torch.cuda.is_available():
        return model.cuda(torch.cuda.current_device())
    return model


def gpt_model(config, settings, shape: FreshShape, **kwargs):
    """A megatron-core GPTModel over the Mix-LN block spec (local backend) of `settings`."""
    from megatron.core.models.gpt import GPTModel  # heavy

    from ..model.specs import get_mixln_decoder_block_spec  # heavy: megatron

    spec = get_mixln_decoder_block_spec(config, backend="local", **settings)
    with _quiet_gpt_deprecation():
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=shape.vocab_size,
                        max_sequence_length=shape.seq_length,
                        share_embeddings_and_output_weights=not shape.untie_embeddings, **kwargs)


def build_megatron_gpt(
    shape: FreshShape,
    post_ln_layers: int = 0,
    scheme: str = "mixln",
    seed: int = 1234,
    config_overrides: Optional[dict] = None,
    settings=None,
):
    """A fresh megatron-core GPTModel over our spec (local backend) on CPU, seeded. `settings`
    (a MixLNSettings, e.g. with a per-layer layout) replaces post_ln_layers / scheme."""
    ensure_megatron_cpu(seed)  # and seeds
    config = megatron_config(shape, **(config_overrides or {}))
    layout = {"settings": settings} if settings is not None else {"post_ln_layers": post_ln_layers, "scheme": scheme}
    return MegatronLM(_to_device(gpt_model(config, layout, shape, position_embedding_type="rope")))


# ----------------------------------------------------------------------------------- interface
class LanguageModel:
    """What the analyses need from a causal LM: `layers` (the decoder layers), `token_losses(ids,
    labels)` ([b, s] cross-entropy, nats), `layer_states(ids)` (L + 1 tensors [b, s, h]: every
    decoder layer's input, then the last layer's output before the final norm) and `bypass(i)`."""

    module: torch.nn.Module
    kind: str = "?"

    @property
    def layers(self) -> Sequence[torch.nn.Module]:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def token_losses(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def layer_states(self, ids: torch.Tensor) -> List[torch.Tensor]:
        raise NotImplementedError

    def _identity_forward(self, layer):
        raise NotImplementedError

    @contextlib.contextmanager
    def bypass(self, index: int):
        """Decoder layer `index` (0-based) returns its input unchanged while inside the block."""
        layer = self.layers[index]
        had_own = "forward" in layer.__dict__
        saved = layer.__dict__.get("forward")
        layer.forward = self._identity_forward(layer)
        try:
            yield layer
        finally:
            if had_own:
                layer.forward = saved
            else:
                del layer.forward

    def describe(self) -> str:
        return f"{self.kind} model with {self.num_layers} layers"


def _causal_mask(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)


def _token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[b, s] per-token cross-entropy of [b, s, V] logits, with torch's fused kernel."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(labels)


class MegatronLM(LanguageModel):
    """A megatron-core GPTModel (TP = PP = 1, on CPU)."""

    kind = "megatron"

    def __init__(self, model, source: str = "fresh", placement=None):
        self.module = model
        self.source = source
        self.placement = placement or getattr(model.decoder.layers[0], "placement", None)

    @property
    def layers(self):
        return list(self.module.decoder.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.module.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _inputs(self, ids):
        b, s = ids.shape
        dev = self.device
        pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)
        return ids.to(dev), pos, _causal_mask(s).to(dev)

    def token_losses(self, ids, labels):
        """Torch's cross-entropy: megatron's vocab-parallel one's value at TP = 1, cheaper on CPU."""
        ids, pos, mask = self._inputs(ids)
        logits = self.module(ids, pos, mask).float()  # [b, s, V]
        return _token_cross_entropy(logits, labels.to(logits.device))

    def layer_states(self, ids):
        states: List[torch.Tensor] = []
        handles = []

        def pre_hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            states.append(x.detach().transpose(0, 1).float().cpu())  # [s, b, h] -> [b, s, h]

        def last_hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            states.append(out.detach().transpose(0, 1).float().cpu())

        layers = self.layers
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(layers[-1].register_forward_hook(last_hook, with_kwargs=True))
        try:
            ids, pos, mask = self._inputs(ids)
            with torch.no_grad():
                self.module(ids, pos, mask)
        finally:
            for h in handles:
                h.remove()
        if len(states) != len(layers) + 1:
            raise RuntimeError(f"expected {len(layers) + 1} layer states, captured {len(states)}")
        return states

    def _identity_forward(self, layer):
        def forward(hidden_states=None, *args, context=None, **kwargs):
            return hidden_states, context
        return forward

    def describe(self) -> str:
        p = self.placement
        where = f" ({p.describe().replace('[mixln_megatron] ', '')})" if p is not None else ""
        return f"megatron-core GPTModel, {self.num_layers} layers, from {self.source}{where}"


class HFLM(LanguageModel):
    """A Hugging Face causal LM whose decoder layers are model.model.layers (LLaMA family)."""

    kind = "hf"

    def __init__(self, model, source: str = "memory"):
        self.module = model
        self.source = source

    @property
    def layers(self):
        return list(self.module.model.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.module.config.vocab_size)

    def token_losses(self, ids, labels):
        return _token_cross_entropy(self.module(input_ids=ids, use_cache=False).logits.float(), labels)

    def layer_states(self, ids):
        """hidden_states[0..L-1] of output_hidden_states (the layer inputs) and the last layer's output.

        The last entry of `hidden_states` is the final norm's output in transformers, so the last
        layer's raw output is taken with a forward hook instead.
        """
        last = []

        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            last.append(out.detach().float())

        handle = self.layers[-1].register_forward_hook(hook)
        try:
            with torch.no_grad():
                out = self.module(input_ids=ids, output_hidden_states=True, use_cache=False)
        finally:
            handle.remove()
        hs = out.hidden_states
        n = self.num_layers
        if hs is None or len(hs) != n + 1 or len(last) != 1:
            raise RuntimeError(f"expected {n + 1} hidden states from output_hidden_states, got "
                               f"{None if hs is None else len(hs)}")
        return [h.detach().float() for h in hs[:n]] + [last[0]]

    def _identity_forward(self, layer):
        def forward(hidden_states, *args, **kwargs):
            return hidden_states
        return forward

    def describe(self) -> str:
        cfg = self.module.config
        post = getattr(cfg, "post_ln_layers", 0)
        scheme = getattr(cfg, "mixln_scheme", "mixln")
        return (f"Hugging Face {type(self.module).__name__}, {self.num_layers} layers "
                f"(post_ln_layers={post}, scheme={scheme}), from {self.source}")


# ----------------------------------------------------------------------------------- text
def default_cache_dir() -> str:
    """MIXLN_ANALYSIS_CACHE, else a folder in the system's temporary directory."""
    return analysis_cache_dir() or os.path.join(tempfile.gettempdir(), "mixln_megatron_data")


def _read_indexed(prefix: str) -> np.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # heavy

    ds = IndexedDataset(prefix, mmap=True)
    parts = [np.asarray(ds[i]) for i in range(len(ds))]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def corpus_tokens(
    text_file: Optional[str] = None,
    tokenizer=None,
    cache_dir: Optional[str] = None,
    max_chars: Optional[int] = None,
) -> np.ndarray:
    """The token stream of `text_file` (default: the shipped corpus), EOD after every paragraph.

    `tokenizer`: a mixln_megatron.data.tokenizer.TokenizerSpec (default: the shipped byte-level BPE).
    """
    if text_file is None and tokenizer is None:
        prefix = prepare_austen_dataset(cache_dir or default_cache_dir(), max_chars=max_chars)
        return _read_indexed(prefix)
    tok = load_tokenizer(tokenizer)
    if text_file is None:
        paragraphs = austen_paragraphs(max_chars=max_chars)
    else:
        with open(text_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if max_chars is not None:
            text = text[:max_chars]
        paragraphs = split_paragraphs(text)
    if not paragraphs:
        raise ValueError(f"{text_file or 'the corpus'}: no text found")
    eod = tok.eod_id
    out: List[int] = []
    step = 512
    for i in range(0, len(paragraphs), step):
        for ids in tok.encode_batch(paragraphs[i:i + step]):
            out.extend(ids)
            if eod is not None:
                out.append(eod)
    return np.asarray(out, dtype=np.int64)


def split_train_valid(tokens: np.ndarray, valid_every: int = 20, block: int = 8192) -> Tuple[np.ndarray, np.ndarray]:
    """Blocks of `block` tokens; block i is validation when i % valid_every == valid_every - 1."""
    n_blocks = (len(tokens) + block - 1) // block
    train, valid = [], []
    for i in range(n_blocks):
        (valid if i % valid_every == valid_every - 1 else train).append(tokens[i * block:(i + 1) * block])
    if not valid:
        raise ValueError(f"too few tokens ({len(tokens)}) for a validation split of 1/{valid_every} of {block}-token blocks")
    return np.concatenate(train), np.concatenate(valid)


def windows(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    """All non-overlapping windows of seq_len + 1 tokens, in order: LongTensor [n, seq_len + 1]."""
    w = seq_len + 1
    n = len(tokens) // w
    if n == 0:
        raise ValueError(f"need at least {w} tokens, got {len(tokens)}")
    return torch.from_numpy(np.ascontiguousarray(tokens[: n * w].reshape(n, w)))


def batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    num_batches: Optional[int] = None,
    seed: Optional[int] = None,
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) batches of non-overlapping windows.

    seed None: windows in corpus order, spread evenly over the stream when fewer than all are
    asked for; otherwise a permutation drawn from `seed` (cycled if more batches are asked for
    than the stream holds).
    """
    all_w = windows(tokens, seq_len)
    n = all_w.shape[0]
    if num_batches is None:
        num_batches = n // batch_size
        if num_batches == 0:
            raise ValueError(f"{n} windows of {seq_len + 1} tokens do not fill one batch of {batch_size}")
    need = num_batches * batch_size
    if seed is None:
        if need <= n:
            idx = torch.linspace(0, n - 1, need).round().long() if need < n else torch.arange(n)
        else:
            idx = torch.arange(need) % n
    else:
        g = torch.Generator().manual_seed(int(seed))
        perms = [torch.randperm(n, generator=g) for _ in range((need + n - 1) // n)]
        idx = torch.cat(perms)[:need]
    chosen = all_w[idx]
    out = []
    for i in range(num_batches):
        w = chosen[i * batch_size:(i + 1) * batch_size]
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


def eval_batches(
    tokens: np.ndarray, num_tokens: int, seq_len: int, batch_size: int = 8
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Windows spread evenly over the stream covering `num_tokens` predicted tokens (fewer if the
    text is shorter), grouped into batches of `batch_size` sequences."""
    n_windows = min(max(1, -(-int(num_tokens) // seq_len)), len(tokens) // (seq_len + 1))
    single = batches(tokens, seq_len, 1, num_batches=n_windows)
    return [(torch.cat([w[0] for w in single[i:i + batch_size]]),
             torch.cat([w[1] for w in single[i:i + batch_size]]))
            for i in range(0, len(single), batch_size)]


def check_vocab(batch_list, vocab_size: int, what: str = "the model") -> None:
    top = max(int(ids.max()) for ids, _ in batch_list)
    top = max(top, max(int(lab.max()) for _, lab in batch_list))
    if top >= vocab_size:
        raise ValueError(f"token id {top} is outside the vocabulary of {what} ({vocab_size}); "
                         "pass the tokenizer the model was trained with (--tokenizer-model)")
