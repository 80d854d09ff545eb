"""The Hugging Face side of the ladder: transformers' own Qwen2 code, float32, on weights we hand it.

`hf_model(config, weights)` is the "HF simulation": `Qwen2ForCausalLM` with the same dequantized
("fake-quantized") weights the engine runs, so the graph rung compares kernels, not quantization.
`hf_decoder_layer(config, weights, layer)` is one `Qwen2DecoderLayer` for the layer rung. Weights come
in as a dict of HF names to float arrays, or to float32 torch tensors already on the device the model
runs on; nothing here imports engine/ or kernels/.

Where it runs (`model_device`): on the GPU when torch sees one, on the CPU otherwise, float32 either way
with TF32 off (`NANOQWEN_REFERENCE_DEVICE=cpu|cuda` forces one). The GPU sums in another order than the
host's BLAS: a float32 rounding difference, orders of magnitude inside the fp16 noise the rungs' floors
measure (ladder/unit/test_gpu_references.py proves it on two models).
"""

from __future__ import annotations

import numpy as np


def _torch():
    import torch

    return torch


class ShadowedKernelsError(ImportError):
    """The Hugging Face `kernels` distribution is installed: transformers imports it as `kernels`, the
    name this project's own kernel package holds in the process."""


def check_transformers() -> None:
    """Refuse, in one line, an environment where transformers would import the Hugging Face `kernels`
    distribution: transformers 5.25 requires it, and imports it (`from kernels import CUDAProperties`)
    as a model is built, where the name `kernels` is this project's package; the failure would come from
    deep inside transformers. The pyproject keeps transformers below 5.25 for this."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("kernels")
    except PackageNotFoundError:
        return
    raise ShadowedKernelsError(
        f"the Hugging Face 'kernels' distribution {found} is installed, which transformers "
        f"{version('transformers')} imports under the name of this project's kernels/ package: "
        "pip install 'transformers<5.25' && pip uninstall -y kernels")


def hf_config(config: dict):
    """A transformers Qwen2Config (float32, eager attention) from a config.json dict."""
    check_transformers()
    from transformers import Qwen2Config

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
            "hidden_act", "bos_token_id", "eos_token_id")
    kwargs = {k: config[k] for k in keys if k in config}
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg = Qwen2Config(**kwargs, use_sliding_window=False, attention_dropout=0.0)
    # transformers 4.x reads `rope_theta`; 5.x reads `rope_parameters`. Set both, whichever is live.
    cfg.rope_theta = float(theta)
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(theta)}
    cfg._attn_implementation = "eager"
    return cfg


def model_device() -> str:
    """"cuda" when torch sees a GPU (TF32 then switched off for the process), else "cpu";
    NANOQWEN_REFERENCE_DEVICE=cpu|cuda overrides."""
    import os

    torch = _torch()
    forced = os.environ.get("NANOQWEN_REFERENCE_DEVICE", "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"NANOQWEN_REFERENCE_DEVICE={forced!r}: expected cpu or cuda")
    device = forced or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("NANOQWEN_REFERENCE_DEVICE=cuda, but torch sees no GPU")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def _as_tensor(a):
    """A float32 torch tensor of `a`: `a` itself when it is already a float32 torch tensor (on any device);
    the same memory when `a` is a writable C-ordered float32 array (no copy); else a float32 copy."""
    torch = _torch()
    if isinstance(a, torch.Tensor):
        return a if a.dtype == torch.float32 else a.float()
    a = np.asarray(a)
    if a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable:
        return torch.from_numpy(a)
    return torch.from_numpy(np.array(a, dtype=np.float32, order="C"))


def _load(module, weights: dict, prefix: str = "", assign: bool = False):
    """Put `weights` (HF names, `prefix` stripped) into `module`. With `assign` the module's parameters
    become the given arrays' own memory (see hf_model); without, they are copied into its parameters."""
    state = {k[len(prefix):]: _as_tensor(weights[k]) for k in weights if k.startswith(prefix)}
    missing, unexpected = module.load_state_dict(state, strict=False, assign=assign)
    missing = [m for m in missing if "rotary_emb" not in m and not m.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the HF module: missing {missing[:5]}, unexpected {unexpected[:5]}")


def hf_model(config: dict, weights: dict):
    """Qwen2ForCausalLM in float32, eval mode, with the given (dequantized) weights, on their device.

    One float32 copy of the weights in memory, not three: the module is built on the meta device (no
    storage, no random init) and its parameters are the tensors of `weights` themselves where they are
    float32 torch tensors (fixtures/dequantized.py's on a GPU) or writable C-ordered float32 arrays
    (its host ones), copies otherwise. The model and the dict then share memory: neither may be written
    afterwards (nothing in the ladder writes either). The rotary embedding's buffers, which are computed
    rather than loaded, are built on the weights' device.
    """
    torch = _torch()
    from transformers import Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    cfg = hf_config(config)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).float()
    _load(model, weights, assign=True)
    device = model.model.embed_tokens.weight.device
    with torch.device(device):
        model.model.rotary_emb = Qwen2RotaryEmbedding(config=cfg)
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"weights do not fit the HF module: no value for {left[:5]}")
    return model.eval()


def hf_decoder_layer(config: dict, weights: dict, layer: int):
    """(Qwen2DecoderLayer, Qwen2RotaryEmbedding) in float32 for layer `layer` of `weights`, sharing their
    memory as `hf_model` does (neither may be written afterwards)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    torch = _torch()
    cfg = hf_config(config)
    with torch.device("meta"):  # no storage and no random init (seconds for a 7B block): the weights are given
        block = Qwen2DecoderLayer(cfg, layer_idx=layer).float().eval()
    _load(block, weights, prefix=f"model.layers.{layer}.", assign=True)
    left = [n for n, t in [*block.named_parameters(), *block.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"weights do not fit the HF decoder layer: no value for {left[:5]}")
    rope = Qwen2RotaryEmbedding(config=cfg)
    return block, rope


def model_input(model, ids):
    """Token ids as the [1, T] long tensor `model` takes, on its device."""
    torch = _torch()
    return torch.tensor([[int(t) for t in ids]], dtype=torch.long, device=model.model.embed_tokens.weight.device)


def hf_logits(model, ids) -> np.ndarray:
    """float32 logits [len(ids), vocab] of one full forward pass (no cache)."""
    torch = _torch()
    with torch.no_grad():
        out = model(model_input(model, ids), use_cache=False)
    return out.logits[0].float().cpu().numpy()


GPU_BLOCK_HIDDEN = 2048  # from this hidden size on, a block's reference runs on a GPU where torch has one


def reference_device(config: dict) -> str:
    """Where a block's float32 reference runs: "cuda" for a large block (the 7B shape: 14 s on 2 host cores,
    milliseconds on a GPU) when torch sees a GPU, else "cpu". Float32 either way, TF32 off: another order of
    float32 sums, well inside the fp16 noise the rung's floor measures."""
    return model_device() if config["hidden_size"] >= GPU_BLOCK_HIDDEN else "cpu"


def hf_block_outputs(config: dict, weights: dict, layer: int, x: np.ndarray):
    """Run transformers' Qwen2DecoderLayer (float32, eager, causal) over x [T, H] at positions 0..T-1.

    Returns (output [T, H], k [T, nkv, d] after RoPE, v [T, nkv, d]) as float64 arrays. K and V are
    what HF's own attention uses: the k_proj/v_proj outputs caught by forward hooks, with k rotated by
    transformers' `apply_rotary_pos_emb` and the same cos/sin the layer receives. A large block runs on
    the GPU when there is one (`reference_device`).
    """
    torch = _torch()
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    device = reference_device(config)
    block, rope = hf_decoder_layer(config, weights, layer)
    block, rope = block.to(device), rope.to(device)
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // nq
    T = x.shape[0]
    caught = {}
    hooks = [getattr(block.self_attn, name).register_forward_hook(
        lambda mod, inp, out, name=name: caught.__setitem__(name, out.detach())) for name in ("k_proj", "v_proj")]
    try:
        with torch.no_grad():
            hidden = torch.from_numpy(np.asarray(x, dtype=np.float32))[None].to(device)  # [1, T, H]
            position_ids = torch.arange(T, device=device)[None]
            cos, sin = rope(hidden, position_ids)
            mask = torch.full((T, T), float("-inf"), device=device).triu(1)[None, None]  # [1, 1, T, T] additive causal mask
            out = block(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin))
            out = out[0] if isinstance(out, tuple) else out
            k = caught["k_proj"].view(1, T, nkv, d).transpose(1, 2)  # [1, nkv, T, d], HF's layout
            v = caught["v_proj"].view(1, T, nkv, d)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
    finally:
        for h in hooks:
            h.remove()
    return (out[0].double().cpu().numpy(), k[0].transpose(0, 1).double().cpu().numpy(), v[0].double().cpu().numpy())


def hf_layer_states(model, ids) -> list[tuple[np.ndarray, np.ndarray]]:
    """For a full forward pass of `model` (from `hf_model`) over `ids`: each decoder layer's
    (input, output) hidden states, float64 [T, H], caught by hooks on the layers themselves."""
    torch = _torch()
    states: list[list] = [[None, None] for _ in model.model.layers]
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: states[i].__setitem__(0, (args[0] if args else kwargs["hidden_states"]).detach()),
            with_kwargs=True))
        hooks.append(layer.register_forward_hook(
            lambda mod, args, out, i=i: states[i].__setitem__(1, (out[0] if isinstance(out, tuple) else out).detach())))
    try:
        with torch.no_grad():
            model(model_input(model, ids), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [(a[0].double().cpu().numpy(), b[0].double().cpu().numpy()) for a, b in states]
