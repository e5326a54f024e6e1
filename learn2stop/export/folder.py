"""The export folder: what may be replaced by an export, and the manifest written with its checksum.

``out_dir`` must be new, empty or a complete earlier export (:func:`export_mismatch`: its manifest is valid and
lists every file in the folder, each with its sha256); anything else is refused before any work
(:mod:`learn2stop.utils.outputs`).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..runtime.manifest import MANIFEST, ManifestError, check_manifest, read_manifest, seal
from ..utils.outputs import OutputError, check_output_folder, writing


class ExportError(ValueError):
    """An export that cannot be made: the message names the file, the rule or the model part."""


def export_mismatch(folder: str | Path) -> str | None:
    """Why ``folder`` is not a complete export of ours, or None if it is: a valid manifest of this format, every
    file it lists present with its sha256, and nothing else in the folder (only then may an export replace it)."""
    folder = Path(folder)
    try:
        m = read_manifest(folder, verify=True)
    except ManifestError as e:
        return str(e).removesuffix("; export the run again")
    except (OSError, UnicodeDecodeError) as e:
        return f"{folder / MANIFEST} cannot be read ({e.strerror or type(e).__name__})"
    listed = {MANIFEST, *m["files"]}
    extra = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if p.name not in listed)
    if extra:
        return f"it also holds {', '.join(extra[:3])}{' and more' if len(extra) > 3 else ''}, not listed in its {MANIFEST}"
    return None


def check_out_dir(out: str | Path | None, arg: str = "--out", run_dir: str | Path | None = None) -> Path:
    """Check, before any work, the folder an export is written to (:func:`learn2stop.utils.outputs.check_output_folder`):
    a new folder, an empty one or a complete earlier export (kept at ``<out>.previous`` when replaced); never a
    record of ``run_dir``, a file, or a folder holding anything else. Returns it absolute."""
    if not out:
        raise ExportError(f"{arg}: give the folder to write the export to (a new folder, or an earlier export)")
    try:
        return check_output_folder(out, arg, export_mismatch, run_dirs=[run_dir] if run_dir else [], what="export")
    except OutputError as e:
        raise ExportError(str(e)) from None


def write_manifest(folder: Path, manifest: dict, out: Path) -> dict:
    """Seal ``manifest`` with its checksum, check it as the runtime will, and write it into ``folder`` (a temporary
    folder, renamed into ``out`` once complete). Returns the sealed manifest."""
    sealed = seal(manifest)
    try:
        check_manifest(sealed, folder / MANIFEST)
    except ManifestError as e:  # the exporter's own bug or a bad argument (e.g. exit costs): never written
        raise ExportError(str(e).removesuffix("; export the run again")) from None
    with writing("out_dir", out):
        (folder / MANIFEST).write_text(json.dumps(sealed, indent=2, allow_nan=False) + "\n")
    return sealed
