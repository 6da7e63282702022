"""The speculative decoder: greedy exactness, tree verification, caches, stopping.

Random tiny targets (LLaVA with 1-D RoPE, Qwen2-VL with M-RoPE). The heads are briefly
trained on each target's own greedy outputs so that drafts are often accepted (deep
paths, non-first siblings, cache reordering); exactness does not depend on it, but a
head that is never accepted would leave most of the decoder untested.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from builders.heads import CHAIN, TREE, assert_tree_children_are_the_heads_top_k, conversations, run
from transformers import DynamicCache

from lab.capture import TracedCapture
from lab.transfers import HostReads
from msd_train.decoding import (
    DecodeConfig,
    HeadDrafter,
    PositionCache,
    Tree,
    Workspace,
    accept_greedy,
    commit,
    decode,
    draft_chain,
    draft_tree,
    generate,
    key_mask,
    prefill,
    read_acceptance,
    verify,
)
from msd_train.decoding.graphs import StepGraphs
from msd_train.decoding.stopping import StopCriteria, find_stop
from msd_train.draft import MSDDraftConfig, MSDDraftModel
from msd_train.errors import ConfigError
from msd_train.evaluation.timing import timed_generate
from msd_train.targets import Encoded, Features

pytestmark = pytest.mark.usefixtures("one_thread")


def emulated() -> Workspace:
    """A workspace whose steps are captured and replayed by the CPU emulation of CUDA graphs."""
    return Workspace(StepGraphs(TracedCapture()))


# ----- greedy exactness ---------------------------------------------------------------


@pytest.mark.parametrize("graphs", ["eager", "emulated_graphs"])
def test_greedy_outputs_match_plain_decoding(setup, graphs):
    """Tree and chain decoding give plain greedy decoding's tokens, eagerly and with every
    step replayed from a captured graph (the CPU emulation: one workspace for all prompts,
    as a benchmark keeps it, so later prompts replay graphs captured for earlier ones)."""
    target, head, prompts = setup
    workspace = emulated() if graphs == "emulated_graphs" else None
    accepted = []
    for name, prompt in prompts.items():
        plain = run(target, None, prompt, method="ar", eos_token_ids=())
        assert plain.tau == 1.0 and len(plain.tokens) == 40
        if workspace is not None:  # the plain loop replayed too
            assert run(target, None, prompt, workspace, method="ar", eos_token_ids=()).tokens == plain.tokens
        for method in (TREE, CHAIN):
            out = run(target, head, prompt, workspace, eos_token_ids=(), **method)
            assert out.tokens == plain.tokens, f"{target.family} {name} {method['method']}"
            accepted += [c.accepted for c in out.cycles]
    assert max(accepted) >= 2 and sum(accepted) / len(accepted) > 0.5, "the head is hardly ever accepted"
    if workspace is not None:
        steps = [key[0] for key in workspace.graphs.graphs]
        assert steps.count("plain") == 1 and steps.count("verify") == 2  # one per shape: tree, chain
        assert workspace.graphs.captures == len(steps) and not workspace.graphs.eager


def test_greedy_exact_with_a_random_head(llava_target):
    """A head that is (almost) never right: every cycle rejects, output still exact."""
    torch.manual_seed(3)
    head = MSDDraftModel(MSDDraftConfig.from_target_config(llava_target.config, "x")).eval()
    prompt = conversations(llava_target)["image"]
    plain = run(llava_target, None, prompt, method="ar", eos_token_ids=())
    for method in (TREE, CHAIN):
        assert run(llava_target, head, prompt, eos_token_ids=(), **method).tokens == plain.tokens


def test_paper_visual_offset_is_exact_too(llava_setup):
    target, head, prompts = llava_setup
    paper = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, "x", visual_offset="paper")).eval()
    paper.load_state_dict(head.state_dict())
    plain = run(target, None, prompts["two_images"], method="ar")
    assert run(target, paper, prompts["two_images"], **TREE).tokens == plain.tokens


# ----- tree verification and caches ---------------------------------------------------


def test_tree_verification_matches_sequential_forward(setup):
    """Every node's logits from the one tree forward equal those of running the target on
    prefix + that node's path one token at a time (positions and mask are right)."""
    target, head, prompts = setup
    state = prefill(target, HeadDrafter(head), prompts["image"])
    state.tokens.append(int(state.next_logits.argmax()))
    tree = draft_tree(state.drafter, target, state.pending(), depth=3, top_k=3, total_tokens=14,
                      sampling=DecodeConfig().sampling)
    assert len(tree) == 14 and not tree.is_chain
    base = state.clone()
    logits, _ = verify(target, state, tree)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    for node in range(len(tree)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        seq = base.clone()
        cache = DynamicCache()
        for i in range(len(seq.target_cache.layers)):
            keys, values = seq.target_cache.committed(i)
            cache.update(keys.clone(), values.clone(), i)
        for depth, n in enumerate(reversed(path)):
            emb = target.embed_tokens(torch.tensor([[tokens[n]]]))
            pos = target.continue_positions(seq.cache_len + depth, 1, seq.rope_deltas)
            hidden, cache = target.run_language_model(emb, pos, None, cache, use_cache=True)
        torch.testing.assert_close(target.lm_head(hidden[0, -1]), logits[node], atol=1e-5, rtol=1e-4)


def test_caches_hold_exactly_the_committed_tokens(setup):
    """After many cycles the target cache equals a plain prefill of the committed
    sequence, and the head's cache equals the head run over it in one go."""
    target, head, prompts = setup
    prompt = prompts["two_images"]
    state = prefill(target, HeadDrafter(head), prompt)
    state.tokens.append(int(state.next_logits.argmax()))
    reordered = 0
    for _ in range(12):
        state.reserve(40)
        tree = draft_tree(state.drafter, target, state.pending(), depth=3, top_k=4, total_tokens=16,
                          sampling=DecodeConfig().sampling)
        logits, hidden = verify(target, state, tree)
        acc = read_acceptance(tree, accept_greedy(tree, logits))
        path = acc.path
        reordered += path != list(range(len(path)))
        commit(state, acc, hidden)
    assert reordered > 0, "no cycle accepted a path that needed moving in the cache"
    new = torch.tensor(state.tokens)
    assert state.cache_len == len(prompt.input_ids) + len(new) - 1

    plain = prefill(target, None, Encoded(torch.cat([prompt.input_ids, new[:-1]]), prompt.loss_mask, prompt.pixel))
    assert plain.target_cache.length == state.target_cache.length
    for i in range(len(state.target_cache.layers)):
        for ours, ref in zip(state.target_cache.committed(i), plain.target_cache.committed(i)):
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)

    # The head over the committed sequence in one pass (features from one target forward).
    ids = torch.cat([prompt.input_ids, new])[None]
    embeds = torch.cat([target.embed(prompt.input_ids[None], prompt.pixel), target.embed_tokens(new[None])], 1)
    pos, deltas = target.position_ids(prompt.input_ids[None], None, prompt.pixel)
    pos = torch.cat([pos, target.continue_positions(len(prompt.input_ids), len(new), deltas)], -1)
    hidden, _ = target.run_language_model(embeds, pos)
    whole = head.target_inputs(Features(embeds, hidden, ids == target.image_token_id, pos))
    ref = head(**whole, use_cache=True).cache
    n = state.drafter.cache.length
    assert n == state.cache_len - 1 - len(path) + 1  # pending: the last cycle's path
    for i, theirs in enumerate(ref.layers):
        keys, values = state.drafter.cache.committed(i)
        torch.testing.assert_close(keys, theirs.keys[..., :n, :], atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(values, theirs.values[..., :n, :], atol=1e-4, rtol=1e-3)


def test_draft_tree_children_are_the_heads_top_k(setup):
    """Each node's children are the head's top tokens after that node's path, with the
    cumulative log-probabilities a from-scratch head rollout gives (tree mask and node
    positions are right)."""
    assert_tree_children_are_the_heads_top_k(*setup)


def test_a_draft_vocabulary_drafts_only_its_tokens_and_keeps_outputs_exact(llava_setup):
    """decoding.draft_vocab=N: the head's logits are the full ones on the N most frequent
    ids of its token counts and -inf elsewhere, every drafted token is one of them, and
    tree and chain outputs still equal plain decoding's."""
    from msd_train.decoding import use_draft_vocabulary
    from msd_train.draft.vocabulary import most_frequent

    target, head, prompts = llava_setup
    prompt = prompts["image"]
    plain = run(target, None, prompt, method="ar", eos_token_ids=())
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    counts[plain.tokens[::3]] += 1  # a third of the answer's tokens are in, so some drafts are refused
    size = int((counts > 0).sum())
    ids = most_frequent(counts, size)
    others = torch.ones(target.vocab_size, dtype=torch.bool)
    others[ids] = False
    states = torch.randn(5, head.config.hidden_size)
    full = head.logits(states, target)
    head.token_counts = counts
    try:
        use_draft_vocabulary(head, target, size)
        part = head.logits(states, target)
        torch.testing.assert_close(part[:, ids], full[:, ids])
        assert torch.isneginf(part[:, others]).all()
        for method in (TREE, CHAIN):
            out = run(target, head, prompt, eos_token_ids=(), draft_vocab=size, **method)
            assert out.tokens == plain.tokens, method["method"]
        state = prefill(target, HeadDrafter(head), prompt)
        state.tokens.append(int(state.next_logits.argmax()))
        tree = draft_tree(state.drafter, target, state.pending(), depth=2, top_k=3, total_tokens=12,
                          sampling=DecodeConfig().sampling)
        drafted = tree.tokens[1:][tree.valid[1:]]
        assert len(drafted) and not others[drafted].any()
        assert_ranks_like_the_whole_vocabulary(HeadDrafter(head), target, head.config.hidden_size)
        # without counts the setting says where they come from; draft_vocab=None lifts it
        del head.token_counts
        with pytest.raises(ConfigError, match="count_tokens.py"):
            run(target, head, prompt, draft_vocab=size, **CHAIN)
        run(target, head, prompt, eos_token_ids=(), **CHAIN)
        assert head.logits(states, target).isfinite().all()
    finally:
        use_draft_vocabulary(head, target, None)
        head.__dict__.pop("token_counts", None)


def assert_ranks_like_the_whole_vocabulary(drafter, target, hidden: int) -> None:
    """A head drafter ranks the tree's children over its head's own ids only: the same tokens
    and scores as the ranking over a whole-vocabulary row (-inf at the other ids) gives."""
    from msd_train.decoding.drafter import Drafter

    out = torch.randn(1, 4, hidden)
    for k in (1, 3):
        fast = drafter.top_children(target, out, DecodeConfig().sampling, k)
        slow = Drafter.top_children(drafter, target, out, DecodeConfig().sampling, k)
        assert fast[1].shape == (4, k) and torch.equal(fast[1], slow[1])
        torch.testing.assert_close(fast[0], slow[0])


def test_an_msd3_head_ranks_its_draft_vocabulary_like_the_whole_one():
    from types import SimpleNamespace

    from builders.heads import msd3_head

    head = msd3_head()
    assert_ranks_like_the_whole_vocabulary(HeadDrafter(head), SimpleNamespace(dtype=torch.float32),
                                           head.config.hidden_size)


def test_a_chain_stopped_by_draft_min_prob_keeps_outputs_exact(setup):
    """decoding.draft_min_prob: a cycle drafts only while the chain's probability under the
    head stays above the bound, down to no draft at all (a plain step); greedy outputs
    still equal plain decoding's."""
    target, head, prompts = setup
    for name, prompt in prompts.items():
        plain = run(target, None, prompt, method="ar", eos_token_ids=())
        full = run(target, head, prompt, eos_token_ids=(), **CHAIN)
        cut = run(target, head, prompt, eos_token_ids=(), draft_min_prob=0.5, **CHAIN)
        assert cut.tokens == plain.tokens, name
        sizes = [c.tree_size for c in cut.cycles]
        assert min(sizes) >= 1 and max(sizes) <= CHAIN["k"] + 1
        assert sum(sizes) < sum(c.tree_size for c in full.cycles), "the bound never shortened a chain"
    with pytest.raises(ConfigError, match="draft_min_prob"):
        DecodeConfig(method="tree", draft_min_prob=0.5)  # a tree is not stopped by it: refused, not ignored
    with pytest.raises(ConfigError, match="plain_rows=3: use auto, 1 or 2"):
        DecodeConfig(plain_rows=3)
    sizes = [c.tree_size for name in prompts for c in run(target, head, prompts[name], eos_token_ids=(),
                                                               draft_min_prob=0.5, **CHAIN).cycles]
    assert 1 in sizes and any(n > 1 for n in sizes), sizes


def test_chain_draft_leaves_head_cache_at_committed_length(llava_setup):
    target, head, prompts = llava_setup
    state = prefill(target, HeadDrafter(head), prompts["text"])
    state.tokens.append(int(state.next_logits.argmax()))
    tree = draft_chain(state.drafter, target, state.pending(), k=5, sampling=DecodeConfig().sampling)
    assert tree.is_chain and len(tree) == 6 and tree.draft_probs is None
    assert state.drafter.cache.get_seq_length() == len(prompts["text"].input_ids)


def test_tree_shape():
    """Ancestor mask, the additive mask verification builds from it and the cache move on a
    hand-made tree."""
    # 0 -> 1 -> 3 ; 0 -> 2 -> 4 -> 5
    tree = Tree(torch.tensor([9, 8, 7, 6, 5, 4]), torch.tensor([-1, 0, 0, 1, 2, 4]), torch.tensor([0, 1, 1, 2, 2, 3]),
                max_depth=3)
    anc = tree.ancestor_mask()
    assert anc[5].tolist() == [True, False, True, False, True, True]
    assert anc[3].tolist() == [True, True, False, True, False, False]
    assert tree.children() == [[1, 2], [3], [4], [], [5], []]
    bias = key_mask(3, 11, anc, torch.float32)  # 3 committed slots, the 6 nodes, 2 slots beyond
    assert bias.shape == (1, 1, 6, 11) and (bias[0, 0, :, :3] == 0).all()
    assert (bias[0, 0, :, 3:9] == 0).equal(anc) and (bias[0, 0, :, 9:] < 0).all()

    assert tree.paths()[5].tolist() == [0, 2, 4, 5] and tree.paths()[3].tolist() == [0, 1, 3, -1]

    dynamic = DynamicCache()
    kv = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 2, 10, 4).contiguous()
    dynamic.update(kv, kv + 100, 0)
    cache = PositionCache.from_cache(dynamic, 16)
    cache.keep(4, torch.tensor([0, 2, 5]))
    cache.length = 7
    keys, values = cache.committed(0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 9]
    assert values[0, 1, :, 0].tolist() == [100, 101, 102, 103, 104, 106, 109]


def test_draft_tree_is_a_valid_eagle2_tree(llava_setup):
    target, head, prompts = llava_setup
    state = prefill(target, HeadDrafter(head), prompts["image"])
    state.tokens.append(int(state.next_logits.argmax()))
    before = state.drafter.cache.get_seq_length()
    tree = draft_tree(state.drafter, target, state.pending(), depth=2, top_k=3, total_tokens=10,
                      sampling=DecodeConfig().sampling)
    assert len(tree) == 10 and tree.tokens[0] == state.tokens[-1]
    assert (tree.parents[1:] < torch.arange(1, 10)).all()  # parents come first
    assert (tree.depths[1:] == tree.depths[tree.parents[1:]] + 1).all()
    assert tree.depths.max() <= 3  # depth 2: up to 3 draft tokens on a path
    assert state.drafter.cache.get_seq_length() == before + 1  # pending fed, tree entries beyond the length
    # depth 0 is just the root's top_k children
    state = prefill(target, HeadDrafter(head), prompts["image"])
    state.tokens.append(int(state.next_logits.argmax()))
    small = draft_tree(state.drafter, target, state.pending(), depth=0, top_k=3, total_tokens=10, sampling=DecodeConfig().sampling)
    assert len(small) == 4 and small.depths.tolist() == [0, 1, 1, 1]


@pytest.mark.parametrize("method", [TREE, CHAIN, dict(method="ar")], ids=["tree", "chain", "ar"])
def test_one_host_read_per_greedy_cycle(llava_setup, method):
    """A greedy cycle reads the device once (the accepted tokens); counted, not timed."""
    target, head, prompts = llava_setup
    state = prefill(target, HeadDrafter(head), prompts["image"], capacity=200)
    config = DecodeConfig(max_new_tokens=24, eos_token_ids=(), **method)
    with HostReads() as reads:
        out = decode(target, state, config)
    assert len(out.cycles) >= 5 and sum(c.accepted for c in out.cycles) > 0 or method["method"] == "ar"
    assert reads.count == 1 + len(out.cycles), reads.names  # the first token, then one per cycle
    assert reads.uploads == []  # and no host data copied to the device (a stream sync on a GPU)
    with HostReads() as old:  # the counter sees the reads the decoder no longer makes
        bool(torch.ones(1).any()), torch.arange(3).tolist(), torch.arange(4)[torch.arange(4) > 1]
    assert old.count == 3


def test_cuda_graphs_setting(llava_setup):
    """auto decodes on a CPU (no capture); asking for graphs on a CPU says what to do."""
    target, head, prompts = llava_setup
    with pytest.raises(ValueError, match="cuda_graphs"):
        DecodeConfig(cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="cuda_graphs=auto"):
        run(target, head, prompts["text"], cuda_graphs=True, **TREE)
    assert run(target, head, prompts["text"], cuda_graphs=False, max_new_tokens=6, **TREE).tokens == \
        run(target, head, prompts["text"], max_new_tokens=6, **TREE).tokens


class FailingCapture:
    """A capture backend that fails as a CUDA capture can: while capturing, or on the first
    replay."""

    device_type = "cpu"

    def __init__(self, at: str):
        self.at = at

    def __call__(self, fn, inputs):
        if self.at == "capture":
            raise RuntimeError("operation not permitted when stream is capturing")
        outputs, _ = TracedCapture()(fn, inputs)

        def replay():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return outputs, replay

    synchronize = staticmethod(lambda: None)


@pytest.mark.parametrize("at", ["capture", "replay"])
def test_a_failing_capture_falls_back_to_eager(llava_setup, caplog, at):
    """A step whose capture (or first replay) fails runs eagerly, after one warning that
    names the step, its shapes and the error; the output is exact and the run goes on."""
    target, head, prompts = llava_setup
    workspace = Workspace(StepGraphs(FailingCapture(at)))
    error = "not permitted when stream is capturing" if at == "capture" else "illegal memory access"
    with caplog.at_level(logging.WARNING, logger="msd_train.decoding.graphs"):
        plain = run(target, None, prompts["image"], workspace, method="ar", eos_token_ids=())
    assert plain.tokens == run(target, None, prompts["image"], method="ar", eos_token_ids=()).tokens
    [warning] = [r.getMessage() for r in caplog.records]
    assert "plain step" in warning and "embeds [1, 1, 32], mask [1, 1, 1, 256]" in warning and error in warning, warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="msd_train.decoding.graphs"):
        for name in ("image", "text"):  # the tree's two steps warn once each, on the first prompt only
            out = run(target, head, prompts[name], workspace, eos_token_ids=(), **TREE)
            assert out.tokens == run(target, head, prompts[name], eos_token_ids=(), **TREE).tokens
    assert sorted(r.getMessage().split(" step ")[0].split()[-1] for r in caplog.records) == ["head", "verify"]
    assert workspace.graphs.graphs == {} and workspace.graphs.eager == {"plain", "head", "verify"}


def test_a_second_prompt_replays_the_first_prompts_graphs(llava_setup):
    """One workspace for a benchmark: the second prompt decodes in the same cache buffers
    with the graphs the first captured, and capture time is kept out of decode time."""
    target, head, prompts = llava_setup
    workspace = emulated()

    def timed(draft, prompt, **config):  # the evaluation runner's timing (msd_train.evaluation.timing)
        return timed_generate(target, draft, prompt, DecodeConfig(max_new_tokens=40, **config), workspace=workspace)

    first = timed(None, prompts["text"], method="ar")
    buffers = workspace.caches["target"].layers[0].keys
    assert workspace.graphs.captures == 1 and first.t_capture > 0
    second = timed(None, prompts["second_turn"], method="ar")
    assert workspace.graphs.captures == 1 and second.t_capture == 0  # replayed, not captured again
    assert workspace.caches["target"].layers[0].keys is buffers
    assert second.tokens == run(target, None, prompts["second_turn"], method="ar").tokens

    for name in ("image", "two_images"):  # speculative: the verify step is captured once for both prompts
        out = timed(head, prompts[name], **TREE)
        assert out.tokens == run(target, head, prompts[name], **TREE).tokens
        phases = sum(c.t_draft + c.t_verify + c.t_accept for c in out.cycles)
        assert 0 < phases <= out.t_total and all(c.t_draft > 0 and c.t_verify > 0 for c in out.cycles)
    steps = [key[0] for key in workspace.graphs.graphs]
    assert steps.count("verify") == 1 and workspace.graphs.backend.captures == len(steps)


def test_the_loop_tells_its_observer_each_phase(llava_setup):
    """The decoder keeps no times: whoever times it (the evaluation runner) is called once the
    prefill is done, then as each cycle starts and as each of its phases ends."""
    target, head, prompts = llava_setup
    seen = []
    config = DecodeConfig(max_new_tokens=12, eos_token_ids=(), **TREE)
    out = generate(target, head, prompts["image"], config, observe=seen.append)
    assert len(out.cycles) > 1 and seen == ["prefill"] + ["cycle", "draft", "verify", "accept"] * len(out.cycles)
    assert out.t_total == 0 and all(c.t_draft == c.t_verify == 0 for c in out.cycles)  # nobody timed it


def test_ensemble_drafting_replays_exactly(llava_setup):
    """Three variants as batch rows (their padding bias an input of the captured head step)."""
    target, head, prompts = llava_setup
    workspace = emulated()
    for mode in ("ibed", "tabed"):
        config = dict(TREE, ensemble=mode, variants=("M", "T", "P"), eos_token_ids=(), max_new_tokens=16)
        out = run(target, head, prompts["image"], workspace, **config)
        assert out.tokens == run(target, None, prompts["image"], method="ar", eos_token_ids=(), max_new_tokens=16).tokens
    assert workspace.graphs.captures > 0 and not workspace.graphs.eager


def test_sampled_decoding_replays_exactly(llava_setup):
    """Sampling over replayed steps draws what eager sampling draws (same generator seed)."""
    from msd_train.decoding import SamplingParams

    target, head, prompts = llava_setup
    workspace = emulated()
    for method in (TREE, CHAIN):
        config = DecodeConfig(**method, sampling=SamplingParams(temperature=0.7), max_new_tokens=16)
        eager, replayed = (generate(target, head, prompts["two_images"], config, torch.Generator().manual_seed(5),
                                    workspace=ws).tokens for ws in (None, workspace))
        assert eager == replayed
    assert workspace.graphs.captures > 0 and not workspace.graphs.eager


def test_the_emulation_freezes_what_a_cuda_graph_freezes():
    """A Python value read while capturing is a constant of every replay (as in a CUDA
    graph); the inputs are read afresh from the static buffers."""
    settings = {"scale": 2.0}
    graphs = StepGraphs(TracedCapture())
    graphs.configure("auto", torch.device("cpu"))
    step = lambda x: (x * settings["scale"],)  # noqa: E731
    assert graphs.run("step", step, x=torch.ones(2))[0].tolist() == [2.0, 2.0]
    settings["scale"] = 3.0
    assert graphs.run("step", step, x=torch.full((2,), 5.0))[0].tolist() == [10.0, 10.0]
    assert graphs.run("step", step, x=torch.ones(3))[0].tolist() == [3.0] * 3  # a new shape: a new capture


# ----- stopping -----------------------------------------------------------------------


def _blocks(out) -> list[int]:
    """Indices of output tokens that were accepted draft tokens (not bonus tokens)."""
    idx, i = [], 1  # token 0 comes from the prefill
    for c in out.cycles:
        idx += list(range(i, i + c.accepted))
        i += c.accepted + 1
    return idx


def test_eos_inside_an_accepted_block(llava_setup):
    target, head, prompts = llava_setup
    prompt = prompts["text"]
    free = run(target, head, prompt, eos_token_ids=(), **TREE)
    candidates = [i for i in _blocks(free) if free.tokens[i] not in free.tokens[:i]]
    assert candidates, "no accepted draft token to turn into EOS"
    i = candidates[0]
    eos = (free.tokens[i],)
    for method in (TREE, CHAIN, dict(method="ar")):
        out = run(target, head, prompt, eos_token_ids=eos, **method)
        assert out.tokens == free.tokens[: i + 1] and out.stop_reason == "eos", method
    spec = run(target, head, prompt, eos_token_ids=eos, **TREE)
    last = spec.cycles[-1]
    assert last.committed < last.accepted + 1  # the block went on past EOS and was cut


def test_stop_strings(llava_setup):
    target, head, prompts = llava_setup
    prompt = prompts["image"]
    free = run(target, None, prompt, method="ar", eos_token_ids=())
    tok = target.tokenizer
    text = tok.decode(free.tokens)
    stop = tok.decode(free.tokens[10:13])
    assert stop and text.index(stop) >= len(tok.decode(free.tokens[:10])) - 1
    n = next(j for j in range(1, 41) if stop in tok.decode(free.tokens[:j]))
    for method in (TREE, CHAIN, dict(method="ar")):
        out = run(target, head, prompt, eos_token_ids=(), stop_strings=[stop], **method)
        assert out.tokens == free.tokens[:n] and out.stop_reason == "stop_string", method


def test_max_new_tokens_is_exact(llava_setup):
    target, head, prompts = llava_setup
    prompt = prompts["second_turn"]
    free = run(target, None, prompt, method="ar", eos_token_ids=(), max_new_tokens=14)
    for n in (1, 2, 3, 5, 8, 13):
        for method in (TREE, CHAIN):
            out = run(target, head, prompt, eos_token_ids=(), max_new_tokens=n, **method)
            assert out.tokens == free.tokens[:n] and out.stop_reason == "max_new_tokens"


def test_find_stop_order():
    c = StopCriteria(max_new_tokens=5, eos_token_ids=(7,))
    assert find_stop([1, 2, 3], 0, c) is None
    assert find_stop([1, 2, 7, 4, 5], 1, c) == (3, "eos")
    assert find_stop([1, 2, 3, 4, 5, 6, 7], 3, c) == (5, "max_new_tokens")
    assert find_stop([1, 2, 3, 4, 7], 3, c) == (5, "eos")


def test_decode_reuses_a_prefill(llava_setup):
    """``decode`` from a cloned prefill gives the same tokens as ``generate``."""
    target, head, prompts = llava_setup
    state = prefill(target, HeadDrafter(head), prompts["image"])
    a = decode(target, state.clone(), DecodeConfig(max_new_tokens=12, **TREE))
    b = decode(target, state.clone(), DecodeConfig(max_new_tokens=12, **TREE))
    assert a.tokens == b.tokens == run(target, head, prompts["image"], max_new_tokens=12, **TREE).tokens


@pytest.mark.slow
def test_decoding_needs_no_training_stack():
    """decoding and evaluation import and run with deepspeed, hydra, wandb, datasets absent."""
    code = (
        "import sys\n"
        "for m in ('deepspeed', 'hydra', 'wandb', 'datasets', 'omegaconf'): sys.modules[m] = None\n"
        "import torch, msd_train.decoding, msd_train.evaluation\n"
        "from builders import tiny_llava_target\n"
        "from msd_train.draft import MSDDraftConfig, MSDDraftModel\n"
        "t = tiny_llava_target()\n"
        "d = MSDDraftModel(MSDDraftConfig.from_target_config(t.config, 'x')).eval()\n"
        "p = t.encode_prompt([{'role': 'user', 'content': 'hello'}], [])\n"
        "out = msd_train.decoding.generate(t, d, p, msd_train.decoding.DecodeConfig(max_new_tokens=4))\n"
        "assert len(out.tokens) >= 1\n"
    )
    import os
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]  # builders, and the checkout above it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent)]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_decoding_yaml_defaults_equal_decode_config():
    """The settings conf/decoding/*.yaml give eval.py and the ones DecodeConfig gives
    library users are the same: a default changed in one place and not the other fails
    here. Method-specific values (tree depth, chain k) are compared for the method whose
    YAML is named after it: tree.yaml and chain.yaml carry DecodeConfig's defaults."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from msd_train.decoding import SamplingParams
    from msd_train.evaluation.run import decode_config

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        for option in ("tree", "chain"):
            yaml = OmegaConf.to_container(compose("eval", [f"decoding={option}"]).decoding)
            lib = DecodeConfig(method=option)
            for key, value in yaml.items():
                if key == "sampling":
                    assert value == vars(SamplingParams()), f"conf/decoding sampling: {value} vs {SamplingParams()}"
                else:
                    mine = getattr(lib, key)
                    assert (list(mine) if isinstance(mine, tuple) else mine) == value, (option, key, value, mine)
            # and decode_config passes exactly that: the composed YAML builds DecodeConfig's defaults
            assert decode_config(yaml) == lib
