"""target=smollm2_llava's builder on a scaled-down LM (no download, no gguf package): the
same code (lab/targets/from_lm.py) wraps a tiny random ChatML LlamaForCausalLM."""

from __future__ import annotations

import hashlib

import pytest
import torch

from lab.targets.random import char_tokenizer
from msd_train.config import CONF_DIR

# SmolLM2-Instruct's template shape (ChatML with a default system prompt), shortened
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def small_lm(seed: int = 0):
    """A random tied-embedding Llama with SmolLM2's special tokens (BOS <|im_start|>, EOS <|im_end|>)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = char_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>", CHATML)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval(), tok


def build(out, seed: int = 0):
    from lab.targets.from_lm import chatml_llava, save_folder

    lm, tok = small_lm()
    model, processor = chatml_llava(lm, tok, seed=seed)
    save_folder(model, processor, out)
    return lm


@pytest.fixture(scope="module")
def built(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("smol") / "llava"
    return build(out), out


def test_scaled_down_folder_loads_and_keeps_the_lm_text_logits(built):
    from transformers import LlavaForConditionalGeneration

    lm, out = built
    model = LlavaForConditionalGeneration.from_pretrained(out).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[1, 30, 31, 45, 60, 2, 70]])
    with torch.no_grad():
        want, got = lm(input_ids=ids).logits, model(input_ids=ids).logits
    v = lm.config.vocab_size
    assert got.shape[-1] == v + 1  # the added <image> token
    assert torch.equal(got[..., :v], want)
    assert torch.all(got[..., v] == 0)  # <image>'s zero row: never a likely next token


def test_build_is_deterministic(built, tmp_path):
    _, out = built
    build(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        a, b = (hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (out, tmp_path / "again"))
        assert a == b, name


def test_target_config_loads_the_folder_and_plain_decoding_matches_the_lm(built):
    """conf/target/smollm2_llava.yaml through the project's loader: text prompts render
    without a doubled BOS and greedy plain decoding gives the source LM's own tokens; an
    image prompt decodes too."""
    from hydra import compose, initialize_config_dir
    from PIL import Image

    from msd_train.decoding.config import DecodeConfig
    from msd_train.decoding.speculative import generate
    from msd_train.targets import load_target

    lm, out = built
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", ["target=smollm2_llava", f"target.name_or_path={out}"])
    tc = cfg.target
    target = load_target(tc.name_or_path, tc.dtype, "cpu", tc.adapter, tc.chat_template, tc.trust_remote_code,
                         tc.attn_implementation)
    assert target.family == "llava" and target.end_of_turn == "<|im_end|>"
    prompt = target.encode_prompt([{"role": "user", "content": "what colour is the circle"}], [])
    assert target.tokenizer.decode(prompt.input_ids).startswith("<|im_start|>system\n")
    assert int((prompt.input_ids == target.tokenizer.convert_tokens_to_ids("<|im_start|>")).sum()) == 3
    config = DecodeConfig(method="ar", max_new_tokens=12, eos_token_ids=())
    plain = generate(target, None, prompt, config)
    ref = lm.generate(input_ids=prompt.input_ids[None], max_new_tokens=12, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt.input_ids):]
    assert plain.tokens == ref.tolist()

    image = Image.new("RGB", (64, 48), (200, 30, 30))
    with_image = target.encode_prompt([{"role": "user", "content": "<image>\nwhat is this"}], [image])
    assert int((with_image.input_ids == target.image_token_id).sum()) == target.tokens_per_image == 36
    assert len(generate(target, None, with_image, config).tokens) == 12


def test_projector_training_moves_only_the_projector_and_lowers_the_loss(tmp_path, one_thread):
    """LLaVA stage 1 as python -m lab.targets.make_smollm2_llava --train-projector runs it."""
    from builders import random_image

    from lab.targets import make_smollm2_llava as script
    from lab.targets.from_lm import chatml_llava
    pairs = []
    for i, answer in enumerate(["Red.", "Blue."]):
        random_image(i, 48).save(tmp_path / f"{i}.png")
        pairs.append((str(tmp_path / f"{i}.png"), "what colour is the shape", answer))
    lm, tok = small_lm()
    model, processor = chatml_llava(lm, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state, curve = script.train_projector(model, processor, pairs, steps=20, batch_size=2, lr=1e-2, seed=0, log_every=5)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {f"model.multi_modal_projector.{k}" for k in state}
    assert [c["step"] for c in curve] == [5, 10, 15, 20] and curve[-1]["loss"] < curve[0]["loss"]


def test_a_head_trained_on_the_scaled_down_target_decodes_exactly(built, tmp_path, one_thread):
    """Both stages of the training recipe (a few steps each) on the built folder, through
    target=smollm2_llava, then the head's tree and chain decoding equal plain decoding on a
    text and an image prompt."""
    from builders import random_image, write_mini_data
    from hydra import compose, initialize_config_dir

    from msd_train.decoding.config import DecodeConfig
    from msd_train.decoding.speculative import generate
    from msd_train.hub import load_head
    from msd_train.targets import load_target
    from msd_train.training import run

    _, out = built
    data = write_mini_data(tmp_path, 16, 4, lambda i: random_image(100 + i, 16), (5, 8, 3, 6))
    common = ["target=smollm2_llava", f"target.name_or_path={out}", *data, f"run_dir={tmp_path / 'run'}",
              "logging.wandb.mode=disabled", "logging.progress=false", "train.loader_workers=0"]
    for stage, steps in (("1", 6), ("2", 4)):
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            cfg = compose("config", [f"stage='{stage}'", f"train.max_steps={steps}", *common])
        run(cfg)
    head = load_head(tmp_path / "run" / "stage2" / "final")
    tc = cfg.target
    target = load_target(tc.name_or_path, tc.dtype, "cpu", tc.adapter, tc.chat_template, tc.trust_remote_code,
                         tc.attn_implementation)
    prompts = [target.encode_prompt([{"role": "user", "content": "what colour is the circle"}], []),
               target.encode_prompt([{"role": "user", "content": "<image>\nwhat is this"}], [random_image(7, 32)])]
    for prompt in prompts:
        plain = generate(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=16, eos_token_ids=()))
        for method in ("tree", "chain"):
            spec = generate(target, head, prompt, DecodeConfig(method=method, max_new_tokens=16, eos_token_ids=()))
            assert spec.tokens == plain.tokens, method
