"""Publish an export folder to the Hugging Face Hub with a generated model card.

`push_head` talks to the Hub through a client with two methods, `create_repo` and
`upload_folder` (`huggingface_hub.HfApi` by default); tests pass a recording fake.
The token is handed to the client only: it is never printed, logged or written, and
is scrubbed from any error the client raises.

What goes up is what a user elsewhere can read: the weights as they are, and the JSON side
files (config, training record, import record, evaluation report) with every local
absolute path masked as the model card masks them (``card.public``: ``<local>/NAME``).
Both a push and a dry run stage those exact files in a folder first (:func:`stage`); a dry
run keeps it and names it, so the files can be read before anything is published.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from msd_train.errors import PushError
from msd_train.hub.card import find_report, model_card, public, read_training
from msd_train.hub.folders import IncompleteHeadError, export_weight_files, load_export
from msd_train.hub.reference import IMPORT_RECORD
from msd_train.outputs import output_dir
from msd_train.paths import check_repo_id, user_path

log = logging.getLogger(__name__)

#: Files of an export folder that are published besides the weights (local paths masked).
SIDE_FILES = ("config.json", "training.json", IMPORT_RECORD)


@dataclass
class PushPlan:
    """What would be uploaded: (name in the repo, source) where the source is a file uploaded
    as it is (the weights) or the text uploaded under that name (JSON with its local paths
    masked, the card)."""

    folder: Path
    repo_id: str
    files: list[tuple[str, Path | str]]
    card: str
    report_path: Path | None

    def listing(self) -> list[tuple[str, int]]:
        return [(name, src.stat().st_size if isinstance(src, Path) else len(src.encode())) for name, src in self.files]


def masked(value):
    """A JSON value with every local absolute path in its strings (keys too) masked (``card.public``)."""
    if isinstance(value, str):
        return public(value)
    if isinstance(value, dict):
        return {public(str(k)): masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


def masked_json(path: Path) -> str:
    return json.dumps(masked(json.loads(path.read_text())), indent=1) + "\n"


def stage(plan: PushPlan, folder: Path) -> None:
    """Write the files ``plan`` uploads into ``folder``: the weights linked (or copied), the rest as text."""
    for name, src in plan.files:
        if isinstance(src, str):
            (folder / name).write_text(src)
            continue
        try:
            os.link(src, folder / name)  # same bytes, no copy of a large weight file
        except OSError:
            shutil.copy2(src, folder / name)


def plan_push(
    checkpoint: str | Path,
    repo_id: str,
    report: str | Path | None = None,
    license: str = "apache-2.0",
    datasets: list[str] | None = None,
    base_model: str | None = None,
) -> PushPlan:
    """Check the export folder (refusing an incomplete one) and build the card.
    `base_model`: the target's Hub id for the card (see `model_card`)."""
    folder = user_path(checkpoint)
    if not folder.is_dir():
        raise IncompleteHeadError(f"checkpoint={checkpoint}: no such folder")
    if not (folder / "config.json").is_file() and (folder / "final" / "config.json").is_file():
        log.info("checkpoint=%s is a stage folder; pushing its final export %s/final", folder, folder)
        folder = folder / "final"
    if not (folder / "config.json").is_file():
        raise IncompleteHeadError(
            f"checkpoint={folder}: no config.json, so no head to push. Pass an export folder "
            f"(RUN_DIR/stageN/final, or the out= of scripts/export.py / scripts/import_reference.py)"
        )
    weights = export_weight_files(folder)  # raises when missing
    model = load_export(folder)  # raises when the weights do not load into the configured head
    report_path = find_report(folder, report)
    report_data = json.loads(report_path.read_text()) if report_path else None
    files: list[tuple[str, Path | str]] = [(p.name, p) for p in weights]
    files += [(name, masked_json(folder / name)) for name in SIDE_FILES if (folder / name).is_file()]
    if report_path:
        files.append(("report.json", masked_json(report_path)))
    imported = json.loads((folder / IMPORT_RECORD).read_text())["source"] if (folder / IMPORT_RECORD).is_file() else None
    listing = PushPlan(folder, repo_id, files, "", report_path).listing()
    card = model_card(
        model.config, repo_id, read_training(folder), report=report_data,
        report_name="report.json" if report_path else None, files=listing, license=license, datasets=datasets,
        num_parameters=model.num_parameters(), dtype=str(model.dtype).replace("torch.", ""), imported_from=imported,
        base_model=base_model,
    )
    return PushPlan(folder, repo_id, [*files, ("README.md", card)], card, report_path)


def _scrub(text: str, token: str | None) -> str:
    for secret in (token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")):
        if secret:
            text = text.replace(secret, "***")
    return text


def push_head(
    checkpoint: str | Path,
    repo_id: str,
    private: bool = False,
    dry_run: bool = False,
    report: str | Path | None = None,
    token: str | None = None,
    client=None,
    license: str = "apache-2.0",
    datasets: list[str] | None = None,
    commit_message: str | None = None,
    echo=print,
    base_model: str | None = None,
    staging: str | Path | None = None,
) -> PushPlan:
    """Create `repo_id` if missing and upload the export folder with its model card.

    `dry_run`: list the files, print the card and stage the exact files a push uploads in
    ``staging`` (a new folder, refused when it holds anything this command did not make;
    None: a new folder under the system's temporary folder), named, for the user to read;
    nothing is uploaded. `token`: given to the
    client only (default: HF_TOKEN or the cached `huggingface-cli login`). `base_model`:
    the target's Hub id, named in the card's metadata, title and usage snippet (needed when
    the head was trained on a local copy of the target). Returns the plan that was (or
    would be) uploaded.
    """
    # Before anything is read or printed: an invalid id, or a real push without a token, is refused.
    check_push(repo_id, dry_run or client is not None, token)
    plan = plan_push(checkpoint, repo_id, report, license, datasets, base_model)
    plan.card = _scrub(plan.card, token)
    plan.files = [(name, plan.card if name == "README.md" else src) for name, src in plan.files]
    echo(f"head: {plan.folder}")
    echo(f"report: {plan.report_path or 'none (the card says no evaluation was recorded)'}")
    echo(f"{'would upload' if dry_run else 'uploading'} to {repo_id} ({'private' if private else 'public'}):")
    for name, size in plan.listing():
        echo(f"  {name:<32} {size:>14,} bytes")
    if dry_run:
        echo("\n----- README.md -----\n" + plan.card)
        if staging is None:
            where = Path(tempfile.mkdtemp(prefix="msd-push-"))
            stage(plan, where)
        else:
            where = user_path(staging)
            with output_dir(where, "scripts/push_to_hub.py", sources=[plan.folder]) as tmp:
                stage(plan, tmp)
        echo(f"\nstaged in {where}: the exact files a push uploads (read them; nothing was uploaded)")
        return plan
    if client is None:
        from huggingface_hub import HfApi

        client = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="msd-push-") as tmp:
        staged = Path(tmp)
        stage(plan, staged)
        try:
            client.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
            result = client.upload_folder(
                repo_id=repo_id, folder_path=str(staged), repo_type="model",
                commit_message=commit_message or f"Upload MSD draft head from {plan.folder.name}",
            )
        except Exception as err:
            why = _scrub(f"{type(err).__name__}: {err}", token).rstrip(". ")
            raise PushError(f"push to {repo_id} failed: {why}. "
                            f"{_push_fix(err)}") from None
    echo(f"pushed: {getattr(result, 'commit_url', None) or f'https://huggingface.co/{repo_id}'}")
    return plan


def _push_fix(err: Exception) -> str:
    """What to do about a failed push, from what the failure was."""
    import huggingface_hub

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set: unset it to push (dry_run=true works offline)"
    if isinstance(err, (OSError, ConnectionError)) or "connect" in str(err).lower():
        endpoint = huggingface_hub.constants.ENDPOINT
        return (f"The Hub at {endpoint} could not be reached: check the network (and HF_ENDPOINT), then run the "
                "same command again; dry_run=true shows what would be uploaded")
    return "Check that the token may write to this repository (HF_TOKEN or `huggingface-cli login`) and try again"


def check_push(repo_id: str, dry_run: bool, token: str | None = None) -> None:
    """A valid ``repo_id`` (also in dry runs: the card names it) and, for a real push, a token."""
    check_repo_id(repo_id)
    if dry_run or token:
        return
    from huggingface_hub import get_token

    if not get_token():
        raise ValueError("no Hugging Face token: set HF_TOKEN or run `huggingface-cli login` (a token with write "
                         "access), or try it first with dry_run=true")
