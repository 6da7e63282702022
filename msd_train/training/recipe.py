"""The two-stage MSD training recipe over a DeepSpeed engine.

One class, read top to bottom: ``setup()`` builds everything from the config (or from the
newest checkpoint), ``train()`` runs optimizer steps, ``validate()`` measures the
held-out proxies, ``save_checkpoint()`` / ``export()`` write state, ``cleanup()`` closes
loggers. Stage 1 and stage 2 are this same loop; only the curriculum differs.

Reproducibility: the data order comes from the curriculum (a function of seed and step),
and the feature noise of each micro-batch from a generator seeded by (seed, step, rank,
micro-step). A resumed run therefore needs only the step, the two stream positions and
the engine state to continue bit-for-bit where it stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from msd_train.config import pick_device
from msd_train.data.collate import collate
from msd_train.data.curriculum import Curriculum, mm_share
from msd_train.data.dataset import build_split, write_skipped
from msd_train.draft import MSDDraftConfig, MSDDraftModel
from msd_train.features import make_feature_source
from msd_train.targets import load_target
from msd_train.training import checkpoint as ckpt
from msd_train.training import rundir
from msd_train.training.loss import draft_loss_mask, msd_loss
from msd_train.training.validation import evaluate_split

log = logging.getLogger("msd_train")


class TrainingError(RuntimeError):
    """A failure with a message meant for the user (no traceback needed)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str) -> tuple[int, int, int]:
    """Join the process group the launcher prepared, or make a one-process group.

    ``deepspeed`` and ``torchrun`` export RANK/WORLD_SIZE/MASTER_*; plain ``python``
    does not, so those are filled in for a single process.
    """
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo",
                               auto_mpi_discovery=False)
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup, then cosine decay to ``min_ratio`` of the peak."""
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        x = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * x))
    return f


class TrainRecipe:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.stage = int(cfg.stage.id)
        self.run_dir = Path(cfg.run_dir).resolve()
        self.stage_dir = self.run_dir / f"stage{self.stage}"
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
        import torch.distributed as dist

        cfg = self.cfg
        device = pick_device(cfg.target.device)
        self.rank, self.world, self.local_rank = init_distributed(torch.device(device).type)
        self.dist = dist
        if device == "cuda":
            torch.cuda.set_device(self.local_rank)
            device = f"cuda:{self.local_rank}"
        self.device = torch.device(device)
        self.main = self.rank == 0
        self.stage_dir.mkdir(parents=True, exist_ok=True)

        self.target = load_target(
            cfg.target.name_or_path, cfg.target.dtype, self.device, cfg.target.adapter,
            cfg.target.chat_template, cfg.target.trust_remote_code, cfg.target.attn_implementation,
        )
        self.features = make_feature_source(cfg, self.target)
        self.pixels = cfg.features.mode == "online"
        self._setup_data()

        resume_from = self._resume_point()
        self.draft = self._build_draft(resume_from is not None)
        tc = cfg.train
        precision = tc.precision if tc.precision != "auto" else ("bf16" if self.device.type == "cuda" else "fp32")
        if tc.gradient_checkpointing:
            self.draft.activation_checkpointing_enable()
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
        if precision == "bf16":
            # bf16 mode casts every buffer, RoPE frequencies included; inference rebuilds them
            # in fp32, so training must use the same angles.
            rope = self.engine.module.rotary_emb
            self.engine.module.rotary_emb = type(rope)(self.engine.module.config).to(self.device)

        self.global_batch = tc.micro_batch_size * tc.grad_accum * self.world
        cur = cfg.stage.curriculum
        self.curriculum = Curriculum(
            len(self.text), len(self.mm), self.global_batch, cfg.seed,
            cur.start, cur.end, cur.ramp_steps, cur.schedule)
        if resume_from is not None:
            self._load_checkpoint(resume_from)
        self._setup_logging()

    def _setup_data(self) -> None:
        d = self.cfg.data
        if self.stage == 1:
            parts = {"text": list(d.text), "mm": []}
        else:
            parts = {"text": list(d.text), "mm": list(d.multimodal)}
        parts["heldout_text"] = list(d.heldout_text)
        parts["heldout_mm"] = list(d.heldout_multimodal) if self.stage == 2 else []
        splits, skipped = {}, []
        # Rank 0 tokenises and fills the datasets cache; the others wait, then read it.
        if not self.main:
            self.dist.barrier()
        for name, sources in parts.items():
            limit = d.max_heldout if name.startswith("heldout") else None
            sources = [OmegaConf.to_container(s, resolve=True) for s in sources]
            splits[name] = build_split(sources, self.target, d.max_length, d.on_bad_sample, d.cache_dir,
                                       d.num_proc, limit)
            skipped += splits[name].skipped
        if self.main:
            self.dist.barrier()
        self.text, self.mm = splits["text"].dataset, splits["mm"].dataset
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
        if self.stage == 2 and self.cfg.stage.curriculum.end > 0 and len(self.mm) == 0:
            raise TrainingError("stage 2 needs multimodal conversations but data.multimodal yielded none")

    def _build_draft(self, resuming: bool) -> MSDDraftModel:
        """A fresh head (stage 1), the stage-1 export (stage 2), or the shape to resume into."""
        cfg = self.cfg
        overrides = {k: v for k, v in OmegaConf.to_container(cfg.draft, resolve=True).items() if v is not None}
        init = None
        if self.stage == 2 and not resuming:
            init = Path(cfg.stage.init_from) if cfg.stage.init_from else self.run_dir / "stage1" / "final"
            if not (init / "config.json").is_file():
                raise TrainingError(
                    f"stage 2 starts from {init}, which holds no exported head; run stage=1 with the same "
                    f"run_dir first, or set stage.init_from=DIR")
        if init is not None:
            draft = MSDDraftModel.from_pretrained(init)
            if draft.config.target_hidden_size != self.target.hidden_size:
                raise TrainingError(
                    f"{init} was trained for a target with hidden size {draft.config.target_hidden_size}, "
                    f"but {self.target.name} has {self.target.hidden_size}")
            for key in ("decouple_visual", "visual_offset"):
                if key in overrides and getattr(draft.config, key) != overrides[key]:
                    log.info("draft.%s=%s overrides the stage-1 value %s", key, overrides[key],
                             getattr(draft.config, key))
                    setattr(draft.config, key, overrides[key])
        else:
            torch.manual_seed(cfg.seed)
            config = MSDDraftConfig.from_target_config(
                self.target.config, self.target.name, target_adapter=cfg.target.adapter,
                target_vocab_size=self.target.vocab_size, **overrides)
            draft = MSDDraftModel(config)
        return draft.to(self.device).train()

    def _setup_logging(self) -> None:
        lc = self.cfg.logging
        if not self.main or lc.wandb.mode == "disabled":
            return
        import wandb

        name = lc.wandb.name or f"{Path(self.cfg.run_dir).name}-stage{self.stage}"
        self.wandb = wandb.init(
            project=lc.wandb.project, entity=lc.wandb.entity, name=name, mode=lc.wandb.mode,
            dir=str(self.run_dir), config=OmegaConf.to_container(self.cfg, resolve=True),
            resume="allow", id=f"{name}-{self.run_dir.name}".replace("/", "-")[:64],
        )

    # ------------------------------------------------------------------ resume
    def _resume_point(self) -> Path | None:
        """The newest checkpoint that passes the cheap checks (the skipped ones are logged)."""
        self._candidates = [] if str(self.cfg.resume).lower() in ("false", "0", "no") else \
            ckpt.loadable_checkpoints(self.ckpt_root, log_skipped=self.main)
        if not self._candidates and self.main:
            # Killed before its first checkpoint: what it logged is not part of the run that starts now.
            rundir.truncate_metrics(self.stage_dir / "metrics.jsonl", 0)
        return self._candidates[0] if self._candidates else None

    def target_identity(self) -> dict:
        if getattr(self, "_target_identity", None) is None:
            from msd_train.features.generate import target_identity

            self._target_identity = target_identity(self.target, self.cfg.target.adapter)
        return self._target_identity

    def _load_checkpoint(self, path: Path) -> None:
        """Load the newest candidate that loads; a damaged one is skipped with the reason."""
        for cand in self._candidates[self._candidates.index(path):]:
            state = ckpt.read_state(cand)
            refusal = rundir.world_size_refusal(cand, state, self.world)
            if refusal:
                raise TrainingError(refusal)
            if state.get("target") is not None:
                diffs = rundir.identity_differences(state["target"], self.target_identity())
                if diffs:
                    raise TrainingError(
                        f"{cand} was trained on another target than this launch's ({'; '.join(diffs)}). Resume with "
                        f"the checkpoint's target, or start this stage over with resume=false (the old outputs "
                        f"are moved aside).")
            failed = 0.0
            try:
                self.engine.load_checkpoint(str(cand), tag=ckpt.ENGINE_TAG, load_optimizer_states=True,
                                            load_lr_scheduler_states=True)
            except Exception as e:  # a torch zip error, a missing rank's file, DeepSpeed's assertions
                log.warning("rank %d: skipping checkpoint %s: it does not load (%s: %s)", self.rank, cand,
                            type(e).__name__, e)
                failed = 1.0
            # Every rank must resume from the same step: one rank's failure moves all to the next one.
            flag = torch.tensor([failed], device=self.device)
            self.dist.all_reduce(flag)
            if flag.item() > 0:
                continue
            path = cand
            break
        else:
            raise TrainingError(
                f"no checkpoint in {self.ckpt_root} loads (reasons above); move the folder aside to start over, "
                f"or set resume=false (which moves it aside for you)")
        if self.main:
            log.info("resuming from %s", path)
        self.step = state["step"]
        self.curriculum.load_state_dict(state["curriculum"])
        self.bad_total = state["bad_total"]
        self.best_tau = state["best_tau"]
        if state["global_batch"] != self.global_batch:
            raise TrainingError(
                f"{path} was written with a global batch of {state['global_batch']}, this launch has "
                f"{self.global_batch}; keep micro_batch_size * grad_accum * world size the same, or resume=false")
        # Metrics logged after that checkpoint were lost work; drop them so the log stays exact.
        if self.main:
            rundir.truncate_metrics(self.stage_dir / "metrics.jsonl", self.step)

    # ------------------------------------------------------------------ train
    def _micro_batches(self, plan: list[tuple[str, int]]) -> list[list[dict]]:
        """This rank's micro-batches of a global batch, in accumulation order."""
        mb, ga = self.cfg.train.micro_batch_size, self.cfg.train.grad_accum
        rows = [(self.mm if kind == "mm" else self.text)[i] for kind, i in plan]
        out = []
        for a in range(ga):
            start = (a * self.world + self.rank) * mb
            out.append(rows[start:start + mb])
        return out, rows

    def _noise(self, hidden: torch.Tensor, micro: int) -> torch.Tensor:
        tc = self.cfg.train
        if tc.noise == "none" or tc.noise_scale == 0:
            return hidden
        g = torch.Generator(device="cpu").manual_seed(
            hash((self.cfg.seed, self.step, self.rank, micro)) & 0x7FFFFFFF)
        if tc.noise == "uniform":  # EAGLE/MSD: amplitude scale * 512 / L
            amp = tc.noise_scale * 512 / hidden.shape[1]
            n = (torch.rand(hidden.shape, generator=g) - 0.5) * amp
        elif tc.noise == "gaussian":
            n = torch.randn(hidden.shape, generator=g) * tc.noise_scale
        else:
            raise TrainingError(f"train.noise={tc.noise}: use uniform, gaussian or none")
        return hidden + n.to(hidden.device, hidden.dtype)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches of the planned global batch."""
        tc = self.cfg.train
        plan = self.curriculum.plan(self.step)
        micro_batches, rows = self._micro_batches(plan)
        # Normalise by the loss tokens of the whole global batch (every rank knows it).
        n_global = float(sum(sum(r["loss_mask"][2:]) for r in rows))
        sums = torch.zeros(4, dtype=torch.float64)
        bad = 0
        for micro, batch_rows in enumerate(micro_batches):
            batch = collate(batch_rows, self.target, pixels=self.pixels)
            feats = self.features(batch)
            embeds, hidden, replace, raw = self.engine.module.align_inputs(
                feats.inputs_embeds, feats.hidden_states, feats.visual_mask)
            hidden = self._noise(hidden, micro)
            out = self.engine(embeds, hidden, replace, raw, position_ids=feats.position_ids[..., :-1])
            mask = draft_loss_mask(batch["loss_mask"].to(self.device))
            loss, parts = msd_loss(out.last_hidden_state, feats.hidden_states[:, 1:], self.target.lm_head,
                                   mask, n_global, tc.w_feat, tc.w_tok)
            flag = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=self.device)
            self.dist.all_reduce(flag)
            if flag.item() > 0:
                # Dropped on every rank alike, before backward, so no rank's gradients or the
                # engine's accumulation boundary diverge.
                bad += 1
                continue
            # The loss is already this micro-batch's share of the global-batch sum: skip
            # DeepSpeed's division by grad_accum, and undo its average over ranks.
            self.engine.backward(loss * self.world, scale_wrt_gas=False)
            self.engine.step()
            sums += torch.tensor([float(parts["feat_sum"]), float(parts["tok_sum"]),
                                  float(parts["agree_sum"]), float(parts["n"])], dtype=torch.float64)
        self.dist.all_reduce(sums)
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
        n = max(sums[3].item(), 1.0)
        mm = sum(1 for kind, _ in plan if kind == "mm")
        return {"step": self.step + 1, "loss": (tc.w_feat * sums[0].item() + tc.w_tok * sums[1].item()) / n,
                "feat_loss": sums[0].item() / n, "tok_loss": sums[1].item() / n, "top1": sums[2].item() / n,
                "mm_share": mm / len(plan),
                "mm_share_scheduled": mm_share(self.step, **self._cur_kwargs()),
                "lr": self.engine.get_lr()[0], "tokens": float(sum(len(r["input_ids"]) for r in rows)),
                "bad_steps": self.bad_total}

    def _cur_kwargs(self) -> dict:
        c = self.cfg.stage.curriculum
        return {"start": c.start, "end": c.end, "ramp_steps": c.ramp_steps, "schedule": c.schedule}

    def train(self) -> None:
        tc = self.cfg.train
        if self.step >= tc.max_steps and (self.stage_dir / "final" / "config.json").is_file():
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

    def _request_stop(self, signum, frame) -> None:
        # Launchers forward what they receive (deepspeed: Ctrl-C reaches the trainer directly and
        # again as the launcher's SIGTERM), so a repeated signal is the same request, not "stop now
        # and lose the step": SIGKILL is what stops without saving.
        if self.stop_requested:
            log.warning("received signal %d again: still saving the checkpoint after this step "
                        "(SIGKILL stops without saving)", signum)
            return
        self.stop_requested = True
        log.warning("received signal %d: saving a checkpoint after this step", signum)

    def _stop_agreed(self) -> bool:
        """True on every rank if any rank was asked to stop (ranks must save together)."""
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.device)
        self.dist.all_reduce(flag)
        return flag.item() > 0

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
                results[name] = evaluate_split(module, self.target, batches, self.features, self.cfg.eval.rollout)
                pooled.append(results[name])
        finally:
            module.train()
        results["sim_tau"] = sum(r["sim_tau"] for r in pooled) / len(pooled)
        return results

    def _validate_and_log(self) -> None:
        # Every rank computes the same validation (cheap at held-out sizes); no gather needed.
        res = self.validate()
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
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        """Engine state into a temp folder on every rank; rank 0 completes and renames it."""
        tmp = self.ckpt_root / f".tmp-step-{self.step:06d}"
        with ckpt.writing(self.ckpt_root, tmp, f"checkpoint step {self.step}"):
            self.engine.save_checkpoint(str(tmp), tag=ckpt.ENGINE_TAG)
        self.dist.barrier()
        if self.main:
            state = {"step": self.step, "stage": self.stage, "curriculum": self.curriculum.state_dict(),
                     "bad_total": self.bad_total, "best_tau": self.best_tau, "global_batch": self.global_batch,
                     "world_size": self.world, "target": self.target_identity()}
            with ckpt.writing(self.ckpt_root, tmp, f"checkpoint step {self.step}"):
                ckpt.finish(tmp, ckpt.step_dir(self.ckpt_root, self.step), state)
            ckpt.rotate(self.ckpt_root, self.cfg.checkpoint.keep)
        self.dist.barrier()

    def export(self, name: str) -> None:
        """The head alone (config.json + model.safetensors), loadable with from_pretrained."""
        module = self.engine.module
        if self.cfg.deepspeed.get("zero_optimization", {}).get("stage", 0) == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                if self.main:
                    self._export(module, name)
        elif self.main:
            self._export(module, name)
        self.dist.barrier()

    def _export(self, module, name: str) -> None:
        meta = {"stage": self.stage, "step": self.step, "command": " ".join(sys.argv),
                "config": OmegaConf.to_container(self.cfg, resolve=True)}
        module.config.dtype = "float32"
        ckpt.export_atomic(module, self.stage_dir / name, {"training.json": json.dumps(meta, indent=1)})
        log.info("exported %s", self.stage_dir / name)

    def cleanup(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.dist.is_initialized():
            self.dist.barrier()
            self.dist.destroy_process_group()
