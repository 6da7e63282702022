"""A LLaVA target made from a pretrained text-only language model: the LM as it is, a vision
tower taken from another LLaVA folder, and a projector between them.

``lab/targets/make_smollm2_llava.py`` builds ``target=smollm2_llava`` with this (SmolLM2-135M-
Instruct from a GGUF file, the embedded tiny LLaVA's trained tower); ``tests/journeys/test_real_lm.py``
builds a scaled-down one from a random ``LlamaForCausalLM`` through the same functions.
Nothing here needs the ``gguf`` package except :func:`lm_from_gguf`, which imports it lazily.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"


def lm_from_gguf(folder: str | Path, gguf_file: str):
    """(plain ``LlamaForCausalLM``, tokenizer) from a GGUF file in ``folder``.

    transformers dequantises the GGUF weights to fp32 but the model it returns carries a
    GGUF quantisation config and refuses ``save_pretrained``; its weights are copied into a
    plain model of the same configuration, and the two are checked to give equal logits.
    """
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file; say so plainly)
    except ImportError:
        raise SystemExit("reading a GGUF file needs the gguf package: pip install -e '.[real-lm]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, dtype=torch.float32).eval()
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("architectures", None)
    cfg.pop("transformers_version", None)
    lm = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    missing, unexpected = lm.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head.weight is tied to the embeddings: absent from a tied state dict, not missing
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        if not torch.equal(loaded(ids).logits, lm(ids).logits):
            raise RuntimeError("the plain copy of the GGUF model gives different logits")
    return lm, tokenizer


def add_image_token(tokenizer):
    """The tokenizer with ``<image>`` added as a special token (a copy is not made: the
    tokenizer is changed in place and returned); its id is ``len(tokenizer) - 1``."""
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    return tokenizer


def llava_from_lm(lm, tokenizer, vision_source, image_processor, chat_template: str, seed: int = 0,
                  projector: dict[str, torch.Tensor] | None = None, patch_size: int | None = None):
    """(``LlavaForConditionalGeneration``, ``LlavaProcessor``): ``lm`` (a ``LlamaForCausalLM``)
    as the language model, ``vision_source``'s (a LLaVA model) vision tower, a projector from
    the tower's width to the LM's, seeded (or ``projector``, a state dict, e.g. trained ones).

    The tokenizer gains ``<image>``; its embedding row (tied or not, the LM's output row too)
    is zero: the row is never read as input (image features take its place) and a zero
    output row gives it logit 0, far below what a trained LM's next token scores. Every
    other row is the LM's own, so text-only logits equal the LM's on its vocabulary.
    """
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = add_image_token(tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vocab = len(tokenizer)
    text_config = lm.config.to_dict()
    text_config["vocab_size"] = vocab
    for k in ("architectures", "transformers_version", "quantization_config"):
        text_config.pop(k, None)
    vision_config = vision_source.config.vision_config
    tied = bool(lm.config.tie_word_embeddings)
    n_tokens = (vision_config.image_size // vision_config.patch_size) ** 2
    config = LlavaConfig(
        vision_config=vision_config.to_dict(), text_config=text_config, image_token_index=image_token_id,
        image_seq_length=n_tokens, projector_hidden_act="gelu",
        vision_feature_select_strategy=vision_source.config.vision_feature_select_strategy,
        vision_feature_layer=vision_source.config.vision_feature_layer, tie_word_embeddings=tied)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.pad_token_id = pad
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()

    with torch.no_grad():
        emb = lm.get_input_embeddings().weight
        new_emb = torch.zeros(vocab, emb.shape[1], dtype=emb.dtype)
        new_emb[: emb.shape[0]] = emb
        state = {k: v for k, v in lm.model.state_dict().items() if k != "embed_tokens.weight"}
        state["embed_tokens.weight"] = new_emb
        model.model.language_model.load_state_dict(state, strict=True)
        if not tied:
            head = torch.zeros(vocab, emb.shape[1], dtype=emb.dtype)
            head[: emb.shape[0]] = lm.lm_head.weight
            model.lm_head.weight.copy_(head)
        model.model.vision_tower.load_state_dict(vision_source.model.vision_tower.state_dict(), strict=True)
        if projector is not None:
            model.model.multi_modal_projector.load_state_dict(projector, strict=True)
    if tied and model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("the LLaVA model did not tie lm_head to the embeddings as the LM does")
    eos = lm.generation_config.eos_token_id if lm.generation_config.eos_token_id is not None else tokenizer.eos_token_id
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = tokenizer.bos_token_id, eos, pad
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer,
        patch_size=patch_size or vision_config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1, chat_template=chat_template, image_token=IMAGE_TOKEN)
    return model, processor


def chatml_llava(lm, tokenizer, seed: int = 0, projector: dict[str, torch.Tensor] | None = None,
                 tower: str | Path | None = None):
    """``llava_from_lm`` for a ChatML LM such as SmolLM2-Instruct (the tokenizer's own chat
    template) with the tower and image processor of the LLaVA folder ``tower`` (default: the
    embedded tiny LLaVA, data/tiny-llava, whose tower was trained here)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from msd_train.config import REPO_ROOT

    if tokenizer.chat_template is None:
        raise ValueError("the LM's tokenizer has no chat template to give the LLaVA target")
    # SmolLM2's chat format opens every turn with <|im_start|>, its nominal BOS; its
    # tokenizer adds no BOS, and the project's encoder would add one while bos_token is
    # set (a doubled <|im_start|> the model never saw).
    tokenizer.bos_token = None
    lm.generation_config.bos_token_id = None
    tower = Path(tower) if tower is not None else REPO_ROOT / "data" / "tiny-llava"
    source = LlavaForConditionalGeneration.from_pretrained(tower)
    image_processor = AutoProcessor.from_pretrained(tower).image_processor
    return llava_from_lm(lm, tokenizer, source, image_processor, tokenizer.chat_template, seed, projector)


def text_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a text-only forward (works for a causal LM and a LLaVA model alike)."""
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def save_folder(model, processor, out: str | Path) -> Path:
    """Save to ``out``, replacing it only once the new folder is complete."""
    from msd_train.runtime import atomic_dir

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)

    atomic_dir(out, write)
    return Path(out)
