"""The target adapter contract, run over every family on tiny random models.

One builder (``lab.targets.random.random_target``) makes a random model of each family
(LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL) with the processor its adapter
reads; every test below runs on each. Images of different sizes and aspect ratios give
different token counts (LLaVA-NeXT's anyres tiles, the Qwen grids) and different position
offsets after each image.
"""

from __future__ import annotations

import pytest
import torch
from builders import fit_head, image_prompts, model_inputs, padded, random_image, wide_image, write_mini_data
from builders.runs import recipe

from lab.targets.random import FAMILY_NAMES, random_target, save_random_target
from msd_train.decoding import DecodeConfig, generate
from msd_train.draft import MSD3DraftConfig, MSDDraftConfig, MSDDraftModel
from msd_train.hf_compat import cache_kwargs
from msd_train.targets import ADAPTERS, FAMILIES, adapter_class, target_shapes, transformers_at_least, wrap_target
from msd_train.targets.protocol import PROTOCOL_MEMBERS, TargetProtocol

pytestmark = pytest.mark.usefixtures("one_thread")

CONV = [
    {"role": "user", "content": "<image>\nwhat colour is the shape"},
    {"role": "assistant", "content": "it is red"},
    {"role": "user", "content": "and the <image> second one"},
    {"role": "assistant", "content": "a blue circle"},
]
TEMPLATE = {"llava": "vicuna_v1", "llava_next": "vicuna_v1"}  # the others: chatml_qwen


def families(names):
    """``names`` as parameters, each skipped where the installed transformers is older than
    its adapter was tested on (``Target.min_transformers``: Qwen3-VL on the floor run)."""
    return [pytest.param(f, marks=pytest.mark.skipif(
        bool(FAMILIES[f].min_transformers) and not transformers_at_least(FAMILIES[f].min_transformers),
        reason=f"{f} needs transformers >= {FAMILIES[f].min_transformers}")) for f in names]


_TARGETS: dict = {}


def make_target(family: str):
    if family not in _TARGETS:
        model, proc = random_target(family)
        _TARGETS[family] = wrap_target(model, proc, f"tiny-random-{family}")
    return _TARGETS[family]


@pytest.fixture(params=families(FAMILY_NAMES))
def target(request):
    return make_target(request.param)


def reset_rope_cache(target):
    """The M-RoPE models keep the last prompt's rope deltas between calls of their own forward."""
    if hasattr(target.model.model, "rope_deltas"):
        target.model.model.rope_deltas = None


# ----- the registry -------------------------------------------------------------------


def test_every_family_has_an_adapter_a_builder_and_shapes():
    assert sorted(FAMILIES) == sorted(FAMILY_NAMES)
    assert len({cls.family for cls in ADAPTERS}) == len(ADAPTERS) - 1  # Qwen2.5-VL keeps Qwen2-VL's store identity
    shapes = target_shapes()
    assert {"llava15_7b", "llava16_7b", "qwen2vl_7b", "qwen25vl_7b", "qwen3vl_8b"} <= set(shapes)
    assert {s["family"] for s in shapes.values()} == set(FAMILY_NAMES)
    for family in FAMILY_NAMES:
        assert type(random_target(family)[0]).__name__ == {
            "llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
            "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
            "qwen3_vl": "Qwen3VLForConditionalGeneration"}[family]
    with pytest.raises(ValueError, match="'gemma3' is not a supported target"):
        adapter_class(type("C", (), {"model_type": "gemma3"})())


def test_head_defaults_of_the_published_shapes():
    """The draft head each published target gets from its config alone: layer family, M-RoPE
    sections, and the layers an msd3 head reads (Qwen3-VL's low layer after deepstack)."""
    from transformers import LlavaNextConfig, Qwen3VLConfig

    s = target_shapes()["qwen3vl_8b"]
    qwen3 = Qwen3VLConfig(text_config=s["text"], vision_config=s["vision"])
    assert list(qwen3.vision_config.deepstack_visual_indexes) == [8, 16, 24]
    head = MSD3DraftConfig.from_target_config(qwen3, "Qwen/Qwen3-VL-8B-Instruct")
    assert head.feature_layers == [4, 18, 33]  # not 2: hidden_states[2..3] miss later deepstack injections
    assert head.mrope_section == [24, 20, 20] and head.layer_family == "qwen2"
    assert head.target_model_type == "qwen3_vl"  # what model cards name the target's family by
    assert "mrope_interleaved" not in head.rope_parameters
    # without mrope_section in its config Qwen3-VL's rotary uses [24, 20, 20]: so does the head
    qwen3.text_config.rope_parameters.pop("mrope_section")
    assert MSDDraftConfig.from_target_config(qwen3, "x").mrope_section == [24, 20, 20]

    s = target_shapes()["llava16_7b"]
    nxt = LlavaNextConfig(text_config=dict(s["text"], model_type="llama"), vision_config=s["vision"],
                          image_grid_pinpoints=s["image_grid_pinpoints"])
    head = MSD3DraftConfig.from_target_config(nxt, "llava-hf/llava-v1.6-vicuna-7b-hf")
    assert head.feature_layers == [2, 16, 29] and head.layer_family == "llama" and head.mrope_section is None
    assert head.target_model_type == "llava_next"


# ----- features and positions ---------------------------------------------------------


def test_features_equal_the_models_own_forward(target):
    """Embeddings (projector outputs at the image slots), post-norm hidden states, layer
    inputs and logits equal the model's own forward, alone and in a right-padded batch."""
    a = target.encode(CONV, [random_image(1, 32), wide_image(2)])
    b = target.encode(CONV[:2], [random_image(3, 24)])
    visual = a.input_ids == target.image_token_id
    layers = [0, 1, 2] if target.family == "qwen3_vl" else [0, 1]

    feats = target.features(a.input_ids[None], None, a.pixel, layers=layers)
    out = target.model(**model_inputs(target, a.input_ids[None], a.pixel), output_hidden_states=True)
    reset_rope_cache(target)
    assert torch.equal(feats.inputs_embeds[0][visual], target.visual_embeddings(a.pixel))
    assert torch.equal(feats.visual_mask[0], visual)
    torch.testing.assert_close(feats.hidden_states, out.hidden_states[-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(target.lm_head(feats.hidden_states), out.logits, rtol=0, atol=1e-5)
    H = target.hidden_size
    for j, i in enumerate(layers):
        torch.testing.assert_close(feats.layer_states[..., j * H:(j + 1) * H], out.hidden_states[i], rtol=0, atol=1e-5)

    ids, att, pixel = padded([a, b])
    feats = target.features(ids, att, pixel)
    out = target.model(**model_inputs(target, ids, pixel, att), output_hidden_states=True)
    reset_rope_cache(target)
    real = att.bool()
    torch.testing.assert_close(feats.hidden_states[real], out.hidden_states[-1][real], rtol=0, atol=1e-5)
    torch.testing.assert_close(target.lm_head(feats.hidden_states)[real], out.logits[real], rtol=0, atol=1e-5)


def test_visual_tokens_per_image_are_the_models(target):
    """Each image expands to the number of visual embeddings the model's tower gives it:
    fixed for LLaVA-1.5, varying with size and aspect ratio for the others."""
    images = [random_image(1, 32), wide_image(2), random_image(3, 16)]
    pixel, counts = target.image_inputs(images)
    assert sum(counts) == target.visual_embeddings(pixel).shape[0]
    for image, n in zip(images, counts):
        assert target.image_inputs([image])[1] == [n]
    if target.family == "llava":
        assert counts == [target.tokens_per_image] * 3 == [16] * 3
    else:
        assert len(set(counts)) == 3, counts
    if target.family == "llava_next":  # base tile (16) + unpadded tiles, a newline ending each row
        assert counts[:2] == [16 + 8 * 9, 16 + 4 * 9]  # 2 x 2 tiles: 8 rows of 8; 2 x 1: 4 rows of 8


def test_position_ids_are_the_models_own(target):
    """M-RoPE ids and rope deltas are the model's own ``get_rope_index`` and the ids its
    forward builds; 1-D ids count the real tokens from 0. One sample and a padded batch."""
    a = target.encode(CONV, [wide_image(4), random_image(5, 32)])
    b = target.encode(CONV[:2], [random_image(6, 24)])
    for ids, att, pixel in [(a.input_ids[None], None, a.pixel), padded([a, b])]:
        pos, deltas = target.position_ids(ids, att, pixel)
        real = att.bool() if att is not None else torch.ones_like(ids, dtype=torch.bool)
        if not target.uses_mrope:
            assert deltas is None and pos.shape == ids.shape
            assert all(pos[i, real[i]].tolist() == list(range(int(real[i].sum()))) for i in range(len(ids)))
            continue
        model = target.model.model
        types = (ids == target.image_token_id).int()
        own, own_deltas = model.get_rope_index(ids, types, image_grid_thw=pixel["image_grid_thw"], attention_mask=att)
        assert torch.equal(pos[:, real], own[:, real])
        assert deltas.tolist() == own_deltas.flatten().tolist()
        reset_rope_cache(target)
        built = model.compute_3d_position_ids(input_ids=ids, image_grid_thw=pixel["image_grid_thw"],
                                              video_grid_thw=None, inputs_embeds=target.embed(ids, pixel),
                                              attention_mask=att, mm_token_type_ids=types, **cache_kwargs(None))
        reset_rope_cache(target)
        assert torch.equal(pos[:, real], built[:, real])
    if target.uses_mrope:  # the wide image spans 3 rows and 5 columns: text after it continues from the larger side
        pos, deltas = target.position_ids(a.input_ids[None], None, a.pixel)
        first = int((a.input_ids == target.image_token_id).nonzero()[0])
        assert pos[:, 0, first + 15].tolist() == [pos[0, 0, first] + 5] * 3 and int(deltas[0]) < 0


# ----- decoding -----------------------------------------------------------------------


_DECODING: dict = {}


def decoding_setup(target):
    """The prompts and a head fitted to the target's greedy continuations of them, so that
    drafts are often accepted."""
    if target.name not in _DECODING:
        encs = image_prompts(target)
        torch.manual_seed(0)
        head = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, target.name))
        batch = []
        for enc in encs.values():
            new = torch.tensor(generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=32,
                                                                         eos_token_ids=())).tokens)
            # a random model may emit its image placeholder: fit on a text token in its place
            new[new == target.image_token_id] = 0
            ids = torch.cat([enc.input_ids, new])[None]
            f = target.features(ids, None, enc.pixel)
            batch.append((head.target_inputs(f), target.lm_head(f.hidden_states[0, 1:]).argmax(-1)))
        _DECODING[target.name] = encs, fit_head(head, target, batch, 150)
    return _DECODING[target.name]


def test_plain_decoding_equals_transformers_generate(target):
    """The baseline the speedup is measured against is the model's own greedy output."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    for name, enc in image_prompts(target).items():
        ours = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=20, eos_token_ids=()))
        theirs = target.model.generate(**model_inputs(target, enc.input_ids[None], enc.pixel), generation_config=gen)
        reset_rope_cache(target)
        assert ours.tokens == theirs[0, len(enc.input_ids):].tolist(), name


def test_tree_decoding_equals_plain_decoding(target):
    encs, head = decoding_setup(target)
    accepted = []
    for name, enc in encs.items():
        plain = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=32, eos_token_ids=()))
        assert len(plain.tokens) == 32
        tree = generate(target, head, enc, DecodeConfig(method="tree", depth=3, top_k=4, total_tokens=16,
                                                        max_new_tokens=32, eos_token_ids=()))
        assert tree.tokens == plain.tokens, name
        accepted += [c.accepted for c in tree.cycles]
    # most cycles accept a draft token, so the accepted path is moved in both caches each time
    # (a head fitted teacher-forced rarely gets depth 2 right: deep paths are test_decoding's)
    assert sum(a >= 1 for a in accepted) / len(accepted) > 0.7, accepted


# ----- training -----------------------------------------------------------------------


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("family", families(FAMILY_NAMES))
def test_both_training_stages(family, tmp_path):
    """Stage 1 then stage 2 (image conversations half the batch) through the recipe, on the
    family's random model laid out as a Hub folder and loaded by ``load_target``; then an
    msd3 head's first step, whose default layers come from the family."""
    folder = save_random_target(family, tmp_path / "target", seed=1)
    images = lambda i: wide_image(i) if i % 2 else random_image(100 + i, 32)  # noqa: E731
    data = write_mini_data(tmp_path, 10, 4, images, (4, 6, 3, 5))
    common = [f"target.name_or_path={folder}", f"target.chat_template={TEMPLATE.get(family, 'chatml_qwen')}",
              *data, "train.micro_batch_size=2", "train.max_steps=2", "eval.every=100", "checkpoint.every=100",
              "eval.batch_size=4", "train.loader_workers=0", f"run_dir={tmp_path / 'run'}"]
    s1 = recipe(["stage='1'", *common])
    assert s1.target.family == make_target(family).family
    s1.train()
    first = MSDDraftModel.from_pretrained(tmp_path / "run" / "stage1" / "final")
    s2 = recipe(["stage='2'", *common, "stage.curriculum.start=0.5", "stage.curriculum.end=0.5"])
    rows = []
    while s2.step < 2:
        rows.append(s2.train_step())
        s2.step += 1
    assert all(r["mm_share"] == 0.5 and r["loss"] > 0 for r in rows)
    moved = [k for k, v in first.state_dict().items() if not torch.equal(v, s2.engine.module.state_dict()[k].cpu())]
    assert "fc.weight" in moved, "stage 2 did not train the stage-1 head"
    assert s2.validate()["mm"]["sim_tau"] >= 1.0

    m3 = recipe(["stage='1'", *common, "head=msd3", "draft.ttt_steps=2", f"run_dir={tmp_path / 'msd3'}"])
    assert m3.draft.feature_layers == adapter_class(m3.target.config).default_feature_layers(m3.target.config)
    assert m3.train_step()["loss"] > 0


# ----- feature stores -----------------------------------------------------------------


@pytest.mark.parametrize("family", families(["llava_next", "qwen3_vl"]))
def test_feature_store_estimate_and_contents(family, tmp_path):
    """``generate_features`` on the family writes a store, and the dry run's estimate is
    the bytes written: M-RoPE positions are counted for M-RoPE families only (LLaVA-NeXT,
    not "llava", was once counted as one)."""
    from hydra import compose, initialize_config_dir

    from msd_train.config import CONF_DIR
    from msd_train.features.generate import generate

    target = make_target(family)
    images = lambda i: wide_image(i) if i % 2 else random_image(100 + i, 32)  # noqa: E731
    data = [o for o in write_mini_data(tmp_path, 8, 2, images, (4, 6, 3, 5)) if o.startswith("data.")]

    def cfg(path, *extra):
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            return compose("generate_features", [*data, f"target.chat_template={TEMPLATE.get(family, 'chatml_qwen')}",
                                                 f"features.path={path}", "features.samples_per_shard=4",
                                                 "features.dtype=fp32", "progress=false", *extra])

    est = generate(cfg(tmp_path / "dry", "dry_run=true"), target=target)
    real = generate(cfg(tmp_path / "real"), target=target)
    assert est["visual_tokens"] > 0
    assert 0 <= real["totals"]["bytes"] - est["bytes"] < 2000 * len(real["shards"])  # headers aside


def test_a_family_newer_than_the_installed_transformers_is_refused_naming_the_upgrade(monkeypatch):
    model, proc = random_target("llava")
    monkeypatch.setattr(FAMILIES["llava"], "min_transformers", "99.0")
    with pytest.raises(ValueError, match=r"LLaVA targets need transformers >= 99.0 \(installed: .*pip install -U"):
        wrap_target(model, proc, "tiny")


# ----- the declared protocol (msd_train/targets/protocol.py) -------------------------------


def test_every_adapter_satisfies_the_target_protocol(target):
    """Each family's loaded adapter has every member of ``TargetProtocol``, and each method
    takes the protocol's parameters (by name, in order)."""
    import inspect

    assert isinstance(target, TargetProtocol)
    for name in PROTOCOL_MEMBERS:
        assert hasattr(target, name), f"{type(target).__name__} lacks {name}"
        declared = inspect.getattr_static(TargetProtocol, name, None)
        if inspect.isfunction(declared) or isinstance(declared, classmethod):
            want = list(inspect.signature(getattr(TargetProtocol, name)).parameters)
            have = list(inspect.signature(getattr(target, name)).parameters)
            want = [p for p in want if p != "self"]
            assert have[: len(want)] == want, f"{type(target).__name__}.{name}{have} does not take {want}"


def test_every_adapter_class_declares_the_family_facts():
    facts = [n for n, t in TargetProtocol.__annotations__.items() if "ClassVar" in str(t)]
    assert facts
    for cls in ADAPTERS:
        for name in facts:
            assert hasattr(cls, name), f"{cls.__name__} lacks the class-level fact {name}"


def test_the_protocol_declares_what_the_project_uses():
    """Every member of the adapters that code outside msd_train/targets reads from a target
    (``target.X`` / ``self.target.X``) is declared in the protocol."""
    import re
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[2] / "msd_train"
    members = {n for cls in ADAPTERS for n in dir(cls) if not n.startswith("_")} | {"name", "tokenizer",
                                                                                    "chat_template", "model"}
    used = set()
    for path in pkg.rglob("*.py"):
        if "targets" in path.relative_to(pkg).parts:
            continue
        used |= set(re.findall(r"(?<![\w.])(?:self\.)?target\.([a-z_]\w*)", path.read_text())) & members
    assert {"lm_head", "continue_positions", "features"} <= used  # the scan sees the decoder and trainer
    assert used <= set(PROTOCOL_MEMBERS), f"used but not declared in TargetProtocol: {sorted(used - set(PROTOCOL_MEMBERS))}"
