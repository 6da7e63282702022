"""The two-stage MSD training recipe over a DeepSpeed engine.

One class, read top to bottom: ``setup()`` builds everything from the config and the
stage's resume point (``training.resume``: the newest checkpoint, read once by the entry
point), ``train()`` runs optimizer steps, ``validate()`` measures the
held-out proxies, ``save_checkpoint()`` / ``export()`` write state, ``cleanup()`` closes
loggers. Stages are configuration (``conf/stage/*.yaml``): which data splits they read
(``stage.splits``), where the head starts (``stage.init_from``: a fresh head when null, else
an exported one) and the curriculum; this code never asks which stage it runs.

On the device's terms: a DataLoader collates the coming steps in worker processes (pinned
memory on CUDA); a step's metrics accumulate on the device and cost one all-reduce and one
host read per optimizer step; every collective goes through ``msd_train.runtime.Group``,
which puts its inputs on the process group's communication device (CUDA for NCCL).

Reproducibility: the data order comes from the curriculum (a function of seed and step, in
samples of the global batch), and the feature noise of each micro-batch from a generator
seeded by (seed, step, the micro-batch's place in the global batch). A resumed run therefore
needs only the step, the two stream positions and the engine state to continue bit-for-bit
where it stopped; on another number of processes (grad_accum recomputed to keep the global
batch, the engine state loaded from its portable form) it takes the same samples and noise
at every step, equal up to the order of floating-point sums.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from msd_train import runtime
from msd_train.config import stage_splits
from msd_train.data.collate import StepBatches, collate, step_loader
from msd_train.data.curriculum import Curriculum, mm_share, sample_lengths
from msd_train.data.dataset import UNUSABLE, UnusableImage, build_split, record_unusable, split_limit, write_skipped
from msd_train.draft import DraftHead, MSDDraftModel, head_class
from msd_train.draft.vocabulary import draft_vocabulary, load_counts, most_frequent, save_counts
from msd_train.features import make_feature_source
from msd_train.formatting import with_article
from msd_train.paths import portable_name
from msd_train.targets import load_target
from msd_train.targets.identity import target_identity
from msd_train.training import checkpoint as ckpt
from msd_train.training import resume, rundir, wandb_run
from msd_train.training.loss import draft_loss_mask, loss_index
from msd_train.training.objective import Objective, objective_for, train_vocab_refusal
from msd_train.training.validation import evaluate_split

log = logging.getLogger("msd_train")


class TrainingError(RuntimeError):
    """A failure with a message meant for the user (no traceback needed)."""


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup, then cosine decay to ``min_ratio`` of the peak."""
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        x = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * x))
    return f


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with non-finite entries zeroed (identical values where all are finite), so a
    bad micro-batch's zero-weighted loss has zero, not NaN, gradients."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def check_init_from(init: Path, stage: int, target_name: str, hidden_size: int | None, vocab_size: int | None) -> None:
    """``stage.init_from`` can start this stage: an exported head, made for a target of this
    hidden size and vocabulary (None: not known here). Run before anything heavy loads
    (``training.run``, from the target's config.json) and again on the loaded target."""
    if not ckpt.export_complete(init):
        # The default init_from is RUN_DIR/stageN/final: name the command that writes it.
        earlier = init.parent.name
        hint = (f"run stage={earlier[5:]} with the same run_dir first" if init.name == "final"
                and earlier.startswith("stage") and earlier[5:].isdigit() else "export a head there first")
        raise TrainingError(
            f"stage {stage} starts from {init} (stage.init_from), which holds no exported head; "
            f"{hint}, or set stage.init_from=DIR")
    try:
        config = json.loads((init / "config.json").read_text())
    except (OSError, ValueError):
        return  # loading the head says why
    for key, what, have in (("target_hidden_size", "hidden size", hidden_size),
                            ("target_vocab_size", "vocabulary size", vocab_size)):
        if have is not None and config.get(key) is not None and config[key] != have:
            raise TrainingError(
                f"{init} (stage.init_from) was trained for a target with {what} {config[key]}, but {target_name} has "
                f"{have}: it is a head of another target. Set stage.init_from to a head trained on this target "
                f"(stages 1 and 2 with the same target and run_dir give one)")


def check_init_from_config(cfg) -> None:
    """``check_init_from`` before the target loads: its sizes from its config.json."""
    hidden = vocab = None
    try:
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(str(cfg.target.name_or_path),
                                          trust_remote_code=bool(cfg.target.trust_remote_code)).get_text_config()
        hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    except Exception:  # not readable here: the loaded target is checked again
        pass
    check_init_from(Path(cfg.stage.init_from), int(cfg.stage.id), str(cfg.target.name_or_path), hidden, vocab)


class TrainRecipe:
    def __init__(self, cfg: DictConfig, start: resume.ResumePoint | None = None):
        """``start``: where the stage starts (``resume.resume_point``, which the entry point
        reads once); None: ``setup()`` reads it."""
        self.cfg = cfg
        self.start = start
        self.stage = int(cfg.stage.id)
        self.run_dir = Path(cfg.run_dir).resolve()
        self.stage_dir = rundir.stage_dir(cfg)
        self.ckpt_root = self.stage_dir / "checkpoints"
        self.step = 0
        self.bad_streak = 0
        self.bad_total = 0
        self.best_tau = -1.0
        self.wandb = None
        self.stop_requested = False

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        import deepspeed

        cfg = self.cfg
        self.device = runtime.local_device(cfg.target.device)
        self.group = runtime.setup_group(self.device, deepspeed=True, timeout_minutes=cfg.dist.timeout_minutes,
                                         check_hosts=cfg.dist.get("check_hosts", True))
        self.rank, self.world, self.local_rank = self.group.rank, self.group.world, self.group.local_rank
        self.main = self.group.main
        if self.start is None:
            self.start = resume.resume_point(cfg, self.rank, self.world)
        if self.start.grad_accum is not None:  # a checkpoint of another number of processes: its global batch
            OmegaConf.update(cfg, "train.grad_accum", self.start.grad_accum)
        self.stage_dir.mkdir(parents=True, exist_ok=True)

        self.target = load_target(
            cfg.target.name_or_path, cfg.target.dtype, self.device, cfg.target.adapter,
            cfg.target.chat_template, cfg.target.trust_remote_code, cfg.target.attn_implementation,
        )
        self.pixels = cfg.features.mode == "online"
        self._setup_data()

        self.draft, self.objective = self._build_draft()
        self.features = make_feature_source(cfg, self.target, self.draft.feature_layers)
        tc = cfg.train
        precision = tc.precision if tc.precision != "auto" else ("bf16" if self.device.type == "cuda" else "fp32")
        if tc.gradient_checkpointing and self.objective.kind == "on_policy" and self.draft.rollout_reads_cache:
            raise TrainingError(f"train.gradient_checkpointing=true: {with_article(self.draft.architecture)} head's on-policy "
                                "rollout reads its own earlier steps' keys from a cache, which checkpointed layers drop; set "
                                "train.gradient_checkpointing=false (or lower train.rollout_steps to save memory)")
        if tc.gradient_checkpointing and not self.draft.supports_gradient_checkpointing:
            raise TrainingError(f"train.gradient_checkpointing=true: the {self.draft.architecture} head does not "
                                f"support it (one layer: little to save); set train.gradient_checkpointing=false")
        if tc.gradient_checkpointing:
            # The name every transformers 5 release has (activation_checkpointing_enable is
            # newer than 5.17); non-reentrant: recomputes exactly, and needs no input grads.
            self.draft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in self.draft.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(tc.warmup_steps, tc.max_steps, tc.min_lr_ratio))
        ds_config = {
            "train_micro_batch_size_per_gpu": tc.micro_batch_size,
            "gradient_accumulation_steps": tc.grad_accum,
            "gradient_clipping": tc.grad_clip,
            "bf16": {"enabled": precision == "bf16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            **OmegaConf.to_container(cfg.deepspeed, resolve=True),
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.draft, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        ckpt.install_safe_loads(self.engine)  # a resume unpickles no code (msd_train.trust)
        if precision == "bf16":
            # bf16 mode casts every buffer, RoPE frequencies included; inference rebuilds them
            # in fp32, so training must use the same angles.
            rope = self.engine.module.rotary_emb
            self.engine.module.rotary_emb = type(rope)(self.engine.module.config).to(self.device)

        self.global_batch = tc.micro_batch_size * tc.grad_accum * self.world
        cur = cfg.stage.curriculum
        window = int(tc.get("bucket_window") or 0)
        self.curriculum = Curriculum(
            len(self.text), len(self.mm), self.global_batch, cfg.seed,
            cur.start, cur.end, cur.ramp_steps, cur.schedule,
            *([sample_lengths(self.text), sample_lengths(self.mm)] if window else [None, None]), window)
        if self.start.checkpoint is not None:
            self._restore(*resume.load(self.start, self.engine, self.group, self.identity))
            resume.record_applied(self.start, self.step, self.main)  # what this launch changed, now applied
        self.wandb = wandb_run.start(cfg, self.run_dir, self.stage) if self.main else None

    def _setup_data(self) -> None:
        d = self.cfg.data
        names = stage_splits(self.cfg)
        # data.<split> -> (the recipe's name, held out?); a split the stage does not read stays empty.
        parts = {"text": "text", "multimodal": "mm", "heldout_text": "heldout_text",
                 "heldout_multimodal": "heldout_mm"}
        splits, skipped = {}, []
        # Once per job (shared cache) or once per node (node-local cache) ranks tokenise and fill
        # the datasets cache; the others wait, then read it.
        with self.group.cache_first(d.cache_dir, "data.cache_dir"):
            for key, name in parts.items():
                limit = split_limit(d, name)
                sources = [OmegaConf.to_container(s, resolve=True) for s in (d.get(key) or [])] if key in names else []
                splits[name] = build_split(sources, self.target, d.max_length, d.on_bad_sample, d.cache_dir,
                                           d.num_proc, limit)
                skipped += splits[name].skipped
        self.text, self.mm = splits["text"].dataset, splits["mm"].dataset
        self._train_splits = (splits["text"], splits["mm"])  # their token counts: _build_draft
        self.heldout = {k.split("_")[1]: v.dataset for k, v in splits.items() if k.startswith("heldout") and len(v)}
        if self.main:
            if skipped:
                path = self.stage_dir / "skipped_samples.jsonl"
                write_skipped(path, skipped)
                log.warning("skipped %d unusable samples; reasons listed in %s", len(skipped), path)
            log.info("stage %d data: %d text, %d multimodal conversations; held-out %s",
                     self.stage, len(self.text), len(self.mm), {k: len(v) for k, v in self.heldout.items()})
        if len(self.text) + len(self.mm) == 0:
            raise TrainingError("no usable training conversations; run scripts/check_data.py on the data files")
        cur = self.cfg.stage.curriculum
        if max(cur.start, cur.end) > 0 and len(self.mm) == 0:
            raise TrainingError(
                f"stage {self.stage}'s curriculum asks for a multimodal share up to {max(cur.start, cur.end)} but "
                f"{'data.multimodal yielded no usable conversations' if 'multimodal' in names else 'stage.splits lacks multimodal'}")

    def _build_draft(self) -> tuple[DraftHead, Objective]:
        """A fresh head, the exported one the stage starts from (``self.start.init_from``), or
        the shape to resume into. ``draft.architecture`` names the head's class
        (``msd_train.draft.HEADS``)."""
        cfg = self.cfg
        overrides = {k: v for k, v in OmegaConf.to_container(cfg.draft, resolve=True).items() if v is not None}
        try:
            head_cls = head_class(overrides.pop("architecture", "msd"))
        except ValueError as e:
            raise TrainingError(str(e)) from None
        init = self.start.init_from
        if init is not None:
            check_init_from(init, self.stage, self.target.name, self.target.hidden_size, self.target.vocab_size)
            draft = MSDDraftModel.from_pretrained(init)  # the class its config.json names
            if draft.architecture != head_cls.architecture:
                raise TrainingError(
                    f"{init} (stage.init_from) holds {with_article(draft.architecture)} head, but this launch trains "
                    f"draft.architecture={head_cls.architecture}; use head={draft.architecture} or another init_from")
            for key in draft.config.stage_overridable:  # what the head declares a later stage may change
                if key in overrides and getattr(draft.config, key) != overrides[key]:
                    log.info("draft.%s=%s overrides the stage-1 value %s", key, overrides[key],
                             getattr(draft.config, key))
                    setattr(draft.config, key, overrides[key])
        else:
            torch.manual_seed(cfg.seed)
            config = head_cls.config_class.from_target_config(
                self.target.config, portable_name(self.target.name),
                target_adapter=cfg.target.adapter and portable_name(cfg.target.adapter),
                target_vocab_size=self.target.vocab_size, **overrides)
            draft = head_cls(config)
        # this stage's assistant tokens: an msd3 head's draft vocabulary, and every export's
        # token_counts.safetensors (decoding.draft_vocab restricts an msd head to its most frequent)
        self.token_counts = self._resumed_counts()
        if self.token_counts is None:
            self.token_counts = sum(s.token_counts(self.target.vocab_size) for s in self._train_splits)
            earlier = load_counts(init) if init is not None else None
            if earlier is not None and earlier.shape == self.token_counts.shape:
                self.token_counts += earlier  # what the head saw in the stages before this one
        if draft.has_draft_vocabulary and init is None:
            draft.set_vocabulary(*draft_vocabulary(self.token_counts, draft.config.draft_vocab_size))
        try:
            objective = objective_for(draft, cfg.train.get("objective", "supervised"))
        except ValueError as e:
            raise TrainingError(str(e)) from None
        train_vocab = overrides.get("train_vocab", getattr(draft.config, "train_vocab", None))
        if train_vocab is not None:  # the token term over the N tokens this stage's data uses most
            why = train_vocab_refusal(draft.architecture, cfg.train.get("objective", "supervised"), train_vocab)
            if why:
                raise TrainingError(why)
            if isinstance(train_vocab, bool) or not isinstance(train_vocab, int) or \
                    not 0 < train_vocab <= self.target.vocab_size:
                raise TrainingError(f"draft.train_vocab={train_vocab} must be between 1 and the target's vocabulary "
                                    f"({self.target.vocab_size}); drop it to train over the whole vocabulary")
            objective.set_train_vocabulary(self.target, most_frequent(self.token_counts, int(train_vocab)))
        return draft.to(self.device).train(), objective

    def _resumed_counts(self):
        """A resume's token counts: the ones the stage started with, kept in its checkpoints. Counted
        again they would miss the head the stage started from (``stage.init_from`` is read only on
        a fresh start, and may have changed since), and ``draft.train_vocab`` would pick another
        vocabulary for the steps to come than the steps so far were trained over."""
        if self.start.checkpoint is None:
            return None
        for cand in self.start.candidates:
            counts = load_counts(cand)
            if counts is not None and counts.shape == (self.target.vocab_size,):
                return counts
        if self.cfg.stage.init_from:
            log.warning("resume: %s keeps no token counts (written before checkpoints kept them): they are counted "
                        "again from this stage's data alone, without those of the head it started from, so "
                        "draft.train_vocab may now pick another vocabulary than the steps so far used",
                        self.start.checkpoint)
        return None

    # ------------------------------------------------------------------ resume
    @functools.cached_property
    def identity(self) -> dict:
        """The target's identity (``targets.identity``): each checkpoint records it, a resume compares it."""
        return target_identity(self.target, self.cfg.target.adapter)

    def _restore(self, path: Path, state: dict) -> None:
        """The recipe's own state from the checkpoint ``resume.load`` loaded into the engine."""
        if state["global_batch"] != self.global_batch:
            raise TrainingError(
                f"{path} was written with a global batch of {state['global_batch']}, this launch has "
                f"{self.global_batch}; keep micro_batch_size * grad_accum * world size the same, or resume=false")
        self.step = state["step"]
        self.curriculum.load_state_dict(state["curriculum"])
        self.bad_total = state["bad_total"]
        self.best_tau = state["best_tau"]
        # Metrics logged after that checkpoint were lost work; drop them so the log stays exact.
        if self.main:
            rundir.truncate_metrics(self.stage_dir / "metrics.jsonl", self.step)

    # ------------------------------------------------------------------ train
    def _next_batches(self) -> dict:
        """This step's collated micro-batches from the DataLoader (made anew when the step
        is not the one it has ready: at the start, after a resume, or when a caller moved
        ``self.step``)."""
        tc = self.cfg.train
        if getattr(self, "_batches_at", None) != self.step:
            ds = StepBatches(self.text, self.mm, self.target, tc.micro_batch_size, tc.grad_accum, self.rank,
                             self.world, pixels=self.pixels, features=self.features)
            self._batches = iter(step_loader(ds, self.curriculum, self.step, max(tc.max_steps, self.step) + 10**9,
                                             int(tc.loader_workers), self.device.type == "cuda",
                                             int(tc.prefetch)))
        item = next(self._batches)
        assert item["step"] == self.step, (item["step"], self.step)
        if "unusable" in item:
            self._batches_at = None  # the loader stops here; a caller that goes on makes a new one
            raise UnusableImage(*item["unusable"])
        self._batches_at = self.step + 1
        self.curriculum.load_state_dict(item["cursor"])
        return item

    def _to_device(self, batch: dict) -> dict:
        # Non-blocking from pinned memory: the copy overlaps the previous micro-batch's work.
        nb = self.device.type == "cuda"
        out = dict(batch)
        for k in ("input_ids", "attention_mask", "loss_mask"):
            out[k] = batch[k].to(self.device, non_blocking=nb)
        out["pixel"] = {k: v.to(self.device, non_blocking=nb) for k, v in batch["pixel"].items()}
        return out

    def train_step(self) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches of the planned global batch.

        No host synchronisation inside: losses, metric sums and the non-finite flags stay
        on the device; one all-reduce and one host read per step, after the last backward.

        A micro-batch whose features or loss are not finite contributes nothing: its
        inputs are zeroed and its loss multiplied by 0 on the device (its gradients are
        exact zeros), but it still goes through ``engine.backward`` and ``engine.step``, so
        DeepSpeed's micro-step count and accumulation boundary stay on the recipe's step.
        A global batch with no usable micro-batch on any rank steps with learning rate 0
        (weights unchanged; the step counts, as the recipe's does).
        """
        tc = self.cfg.train
        item = self._next_batches()
        micro_batches, n_global = item["micro_batches"], item["n_global"]
        sums, bad = None, torch.zeros((), dtype=torch.float64, device=self.device)  # the head's named sums (float64)
        last = len(micro_batches) - 1
        for micro, batch in enumerate(micro_batches):
            index = loss_index(draft_loss_mask(batch["loss_mask"]))  # on the host: no device sync
            batch = self._to_device(batch)
            index = index.to(self.device, non_blocking=self.device.type == "cuda")
            feats = self.features(batch)
            ok = torch.isfinite(feats.hidden_states).all() & torch.isfinite(feats.inputs_embeds).all()
            if feats.layer_states is not None:
                ok = ok & torch.isfinite(feats.layer_states).all()
            feats = dataclasses.replace(
                feats, inputs_embeds=_finite(feats.inputs_embeds), hidden_states=_finite(feats.hidden_states),
                layer_states=None if feats.layer_states is None else _finite(feats.layer_states))
            # The feature noise's seed is keyed on the micro-batch's place in the global batch (rank
            # r's micro-step a takes its rows (a * world + r) * micro_batch_size on: StepBatches), so
            # a resume on another number of processes draws the same noise for the same samples.
            noise_seed = hash((self.cfg.seed, self.step, 0, micro * self.world + self.rank)) & 0x7FFFFFFF
            loss, parts = self.objective.training_loss(self.target, feats, index, n_global, tc,
                                                       noise_seed=noise_seed, forward=self.engine)
            ok = ok & torch.isfinite(loss)
            # The loss is already this micro-batch's share of the global-batch sum: skip
            # DeepSpeed's division by grad_accum, and undo its average over ranks.
            self.engine.backward(torch.where(ok, loss, torch.zeros_like(loss)) * self.world, scale_wrt_gas=False)
            part = torch.stack([v.double() for v in parts.values()])
            part = torch.where(ok, part, torch.zeros_like(part))
            sums = part if sums is None else sums + part
            bad = bad + (~ok).double()
            if micro == last:
                reduced = self.group.all_reduce(torch.cat([sums, bad[None]])).tolist()  # the step's one host read
                sums, bad = dict(zip(parts, reduced[:-1])), reduced[-1]
                if bad >= len(micro_batches) * self.world:
                    for g in self.engine.optimizer.param_groups:  # the scheduler resets it in step()
                        g["lr"] = 0.0
            self.engine.step()
        if bad:
            self.bad_streak += 1
            self.bad_total += 1
            if self.bad_streak >= tc.max_bad_steps:
                raise TrainingError(
                    f"{self.bad_streak} steps in a row up to step {self.step} had a non-finite loss; likely causes: "
                    f"a learning rate too high (train.lr={tc.lr}), fp16 overflow, or corrupt target features; "
                    f"lower train.lr or resume from an earlier checkpoint")
        else:
            self.bad_streak = 0
        return {"step": self.step + 1, **self.objective.training_metrics(sums, tc),
                "mm_share": item["n_mm"] / item["n_rows"],
                "mm_share_scheduled": mm_share(self.step, **self._cur_kwargs()),
                "lr": self.engine.get_lr()[0], "tokens": item["tokens"], "bad_steps": self.bad_total}

    def _cur_kwargs(self) -> dict:
        c = self.cfg.stage.curriculum
        return {"start": c.start, "end": c.end, "ramp_steps": c.ramp_steps, "schedule": c.schedule}

    def train(self) -> None:
        tc = self.cfg.train
        if self.step >= tc.max_steps and ckpt.export_complete(self.stage_dir / "final"):
            if self.main:
                log.info("stage %d already finished at step %d (%s); nothing to do. Use resume=false to retrain "
                         "or raise train.max_steps to continue.", self.stage, self.step, self.stage_dir / "final")
            return
        bar = None
        if self.main and self.cfg.logging.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=tc.max_steps, initial=self.step, desc=f"stage {self.stage}", dynamic_ncols=True,
                       file=sys.stdout)
        if self.step == 0:
            self._validate_and_log()
        # SIGTERM (preemption, the launcher) and Ctrl-C finish the current step, save a
        # checkpoint and exit; relaunching the same command resumes from it.
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        t0, tokens = time.perf_counter(), 0.0
        while self.step < tc.max_steps:
            try:
                metrics = self.train_step()
            except UnusableImage as e:  # an image damaged or changed under the run
                raise self._unusable(e) from None
            except FileNotFoundError as e:  # an image deleted during the run (launches check them all)
                raise TrainingError(
                    f"image {e.filename} disappeared during training (step {self.step + 1}); launch the same command "
                    f"again: it resumes from the last checkpoint and skips that sample (listed in "
                    f"skipped_samples.jsonl)") from e
            except torch.OutOfMemoryError as e:
                raise TrainingError(
                    f"out of memory at step {self.step}: lower train.micro_batch_size "
                    f"(now {tc.micro_batch_size}) and raise train.grad_accum to keep the global batch, lower "
                    f"data.max_length, set train.gradient_checkpointing=true, or use deepspeed=zero3") from e
            self.step += 1
            tokens += metrics["tokens"]
            metrics["tokens_per_s"] = tokens / (time.perf_counter() - t0)
            self._log(metrics)
            if bar is not None:
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.2f}",
                                mm=f"{metrics['mm_share']:.2f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                bar.update(1)
            last = self.step == tc.max_steps
            if self.step % self.cfg.eval.every == 0 or last:
                self._validate_and_log()
            stop = self._stop_agreed()
            if self.step % self.cfg.checkpoint.every == 0 or last or stop:
                self.save_checkpoint()
            if stop and not last:
                if bar is not None:
                    bar.close()
                raise TrainingError(f"interrupted at step {self.step}; checkpoint saved in {self.ckpt_root}. "
                                    "Launch the same command again to resume.")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if bar is not None:
            bar.close()
        self.export("final")

    def _unusable(self, e: UnusableImage) -> TrainingError:
        """The message for an image found unusable while training; the rank that read it keeps
        it in the data cache, so that the relaunch leaves the sample out
        (``data.on_bad_sample=skip``) or refuses it, named (``error``)."""
        d = self.cfg.data
        kept = record_unusable(d.cache_dir, e.record)
        if kept is None:
            then = ("fix that, then launch the same command again (with no data.cache_dir to keep the finding, a "
                    "relaunch meets it again)")
        elif d.on_bad_sample == "skip":
            then = ("or launch the same command again as it is: it resumes from the last checkpoint and skips that "
                    f"sample (listed in skipped_samples.jsonl; the finding is kept in {Path(d.cache_dir) / UNUSABLE})")
        else:
            then = ("fix that and launch the same command again, or set data.on_bad_sample=skip: the relaunch then "
                    "resumes from the last checkpoint and skips that sample")
        return TrainingError(f"training stopped at step {self.step + 1}: {e}; {then}")

    def _request_stop(self, signum, frame) -> None:
        # Launchers forward what they receive (deepspeed: Ctrl-C reaches the trainer directly and
        # again as the launcher's SIGTERM), so a repeated signal is the same request, not "stop now
        # and lose the step": SIGKILL is what stops without saving.
        if self.stop_requested:
            log.warning("received signal %d again: still saving the checkpoint after this step "
                        "(SIGKILL stops without saving)", signum)
            return
        self.stop_requested = True
        # The deepspeed launcher answers Ctrl-C by terminating the trainer's whole process tree,
        # DataLoader workers included. This step's batches are already here, so a worker's end
        # must not raise (torch's SIGCHLD handler) before the checkpoint is written. A no-op
        # handler rather than SIG_DFL: Python reports a SIGCHLD pending across that switch.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        log.warning("received signal %d: saving a checkpoint after this step", signum)

    def _stop_agreed(self) -> bool:
        """True on every rank if any rank was asked to stop (ranks must save together)."""
        return self.group.any(self.stop_requested)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, object]:
        if not self.heldout:
            return {}
        module = self.engine.module
        module.eval()
        results, pooled = {}, []
        try:
            for name, ds in self.heldout.items():
                bs = self.cfg.eval.batch_size
                batches = (collate([ds[i] for i in range(s, min(s + bs, len(ds)))], self.target, pixels=self.pixels)
                           for s in range(0, len(ds), bs))
                results[name] = evaluate_split(self.objective, self.target, batches, self.features, self.cfg.eval.rollout)
                pooled.append(results[name])
        finally:
            module.train()
        results["sim_tau"] = sum(r["sim_tau"] for r in pooled) / len(pooled)
        return results

    def _validate_and_log(self) -> None:
        # Every rank computes the same validation (cheap at held-out sizes); no gather needed.
        try:
            res = self.validate()
        except UnusableImage as e:  # a held-out image damaged or changed under the run
            raise self._unusable(e) from None
        if not res:
            return
        flat = {"step": self.step, "val/sim_tau": res["sim_tau"]}
        for name, r in res.items():
            if isinstance(r, dict):
                flat[f"val/{name}/loss"] = r["loss"]
                flat[f"val/{name}/sim_tau"] = r["sim_tau"]
                flat[f"val/{name}/top1"] = r["top1"]
                for j, (u, c) in enumerate(zip(r["agree_uncond"], r["agree_cond"])):
                    flat[f"val/{name}/agree_uncond_{j + 1}"] = u
                    flat[f"val/{name}/agree_cond_{j + 1}"] = c
        self._log(flat)
        if self.main:
            log.info("step %d held-out: %s", self.step, ", ".join(
                f"{k} tau={v['sim_tau']:.3f} top1={v['top1']:.3f}" for k, v in res.items() if isinstance(v, dict)))
        if self.step > 0 and res["sim_tau"] > self.best_tau:
            self.best_tau = res["sim_tau"]
            self.export("best")

    def _log(self, metrics: dict) -> None:
        if not self.main:
            return
        with open(self.stage_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.wandb = wandb_run.call(
            self.wandb, "logging", lambda run: run.log({k: v for k, v in metrics.items() if k != "step"},
                                                       step=int(metrics["step"])), self.stage_dir / "metrics.jsonl")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        """Engine state into a temp folder on every rank; rank 0 completes and renames it."""
        tmp = self.ckpt_root / f".tmp-step-{self.step:06d}"
        with ckpt.writing(self.ckpt_root, tmp, f"checkpoint step {self.step}"):
            self.engine.save_checkpoint(str(tmp), tag=ckpt.ENGINE_TAG)
        # the same state whole, for a resume on another number of processes (every rank gathers;
        # ZeRO-3 partitions the module too: its checkpoints resume at their own world size only)
        portable = ckpt.portable_state(self.engine) if self.start.zero_stage < 3 else None
        self.group.barrier()
        if self.main:
            if portable is not None:
                with ckpt.writing(self.ckpt_root, tmp, f"checkpoint step {self.step}"):
                    ckpt.save_portable(portable, tmp)
            state = {"step": self.step, "stage": self.stage, "curriculum": self.curriculum.state_dict(),
                     "bad_total": self.bad_total, "best_tau": self.best_tau, "global_batch": self.global_batch,
                     "world_size": self.world, "zero_stage": self.start.zero_stage, "target": self.identity,
                     "micro_batch_size": int(self.cfg.train.micro_batch_size),
                     "grad_accum": int(self.cfg.train.grad_accum)}
            with ckpt.writing(self.ckpt_root, tmp, f"checkpoint step {self.step}"):
                save_counts(tmp, self.token_counts)  # a resume trains over the same vocabulary (_resumed_counts)
                ckpt.finish(tmp, ckpt.step_dir(self.ckpt_root, self.step), state)
            ckpt.rotate(self.ckpt_root, self.cfg.checkpoint.keep)
        self.group.barrier()

    def export(self, name: str) -> None:
        """The head alone (config.json + model.safetensors), loadable with from_pretrained, in
        float32: the optimizer's master weights. Under bf16 the module holds them rounded to
        bf16; exporting the masters lets stage 2 (``stage.init_from``) continue from the
        trained values, not from their rounding. Every rank takes part (ZeRO gathers them)."""
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {}
        for n, p in self.engine.module.named_parameters():
            master = safe_get_full_fp32_param(p)  # None without a master copy (fp32, no ZeRO): p is it
            weights[n] = (p if master is None else master).detach().to("cpu", torch.float32)
        if self.main:
            meta = {"stage": self.stage, "step": self.step, "command": " ".join(sys.argv),
                    "config": OmegaConf.to_container(self.cfg, resolve=True)}
            ckpt.export_head(self.engine.module, weights, self.stage_dir / name, meta, self.token_counts)
            log.info("exported %s", self.stage_dir / name)
        self.group.barrier()

    def cleanup(self, barrier: bool = True) -> None:
        """``barrier=False`` when another rank is gone (it would never arrive)."""
        self.wandb = wandb_run.call(self.wandb, "finishing its run", lambda run: run.finish(),
                                    self.stage_dir / "metrics.jsonl")
        self._batches = self._batches_at = None  # ends the DataLoader's workers
        self.group.destroy(barrier)  # and DeepSpeed's clone of it (runtime.Group.destroy)
