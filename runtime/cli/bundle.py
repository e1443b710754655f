"""`thaw bundle build`: a bundle from safetensors/JSON/text files, a Hugging Face
`save_pretrained` folder (runtime/bundles/pretrained.py), a .gguf/.pth/.pt file or a
directory of .pth/.pt checkpoints (runtime/bundles/convert.py); and the one line (or
JSON object) that `build` and `verify` print.

What admission and the load will assume is said on stderr: a per-request estimate
(a Hugging Face config.json, a conversion) or, with neither that nor
--per-request-bytes, a warning that nothing is reserved per request; a --config
'dtype' is the model's own key, while Thaw's load dtype is --dtype (the manifest's
"thaw" settings).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from runtime.errors import BundleError


def print_bundle(verb: str, manifest: Any, path: Path, as_json: bool) -> None:
    """One line for a person, or one JSON object for a script (`--json`)."""
    if as_json:
        summary = {
            "id": manifest.id,
            "name": manifest.name,
            "version": manifest.version,
            "path": str(path),
            "files": len(manifest.files),
            "bytes": manifest.total_bytes,
        }
        print(orjson.dumps(summary).decode())
        return
    size = f"{len(manifest.files)} files, {manifest.total_bytes} bytes"
    print(f"{verb} {manifest.id} in {path} ({size})")


def default_dir() -> Path:
    """Where a bundle is written without --out: the bundle source when it is a
    directory (in a function project, the project's bundles/: docs/projects.md),
    else ./bundles."""
    from runtime.settings import Settings

    source = Settings.from_env().bundle_source
    return Path("bundles") if "://" in source else Path(source)


def build(args: argparse.Namespace, config: dict[str, Any]) -> int:
    """`thaw bundle build` with its arguments, `config` the --config object read."""
    from runtime.bundles.manifest import build_bundle
    from runtime.cli.progress import bars

    src = Path(args.src)
    per_request = args.per_request_bytes
    # Thaw's own load settings: the manifest's "thaw", never a key of the model's config.
    thaw = {"dtype": args.dtype} if args.dtype else None
    if "dtype" in config and not args.dtype:
        print(
            "thaw: warning: --config's 'dtype' is handed to the builder as the model's own; "
            "to convert the weights when they load, use --dtype",
            file=sys.stderr,
        )
    pretrained = None
    if src.is_dir():
        from runtime.bundles.pretrained import pretrained_config

        pretrained = pretrained_config(src)
    with bars(args.json) as live:
        # On a terminal, bars for the conversion (tensors) and the hashing (bytes);
        # piped or with --json, the output it always had.
        hashing = live.reporter(f"hashing {src.name}") if live is not None else None
        if src.is_file() and src.suffix.lower() in {".gguf", ".pth", ".pt"}:
            # Conversions write safetensors into a staging dir; pickle never reaches the bundle.
            from runtime.bundles.convert import Progress, convert_source

            out = Path(args.out) if args.out else default_dir() / args.name
            progress: Progress = sys.stderr
            if live is not None:
                progress = live.reporter(f"converting {src.name}", unit="items")
            converted = convert_source(src, out, progress=progress)
            config = {**converted.config, **config}
            if per_request is None:
                per_request = converted.per_request_bytes
            manifest = build_bundle(
                out,
                args.name,
                version=args.version,
                out=out,
                config=config,
                per_request_bytes=per_request or 0,
                weights_bytes=converted.weights_bytes,
                kv_bytes_per_token=converted.kv_bytes_per_token,
                on_progress=hashing,
                thaw=thaw,
            )
        elif pretrained is not None:
            # A save_pretrained folder: config.json is the config, the rest its files (a
            # Trainer's optimizer.pt or a pytorch_model.bin beside them is left out).
            from runtime.bundles.pretrained import build_pretrained

            out = Path(args.out) if args.out else default_dir() / args.name
            manifest = build_pretrained(
                src,
                args.name,
                version=args.version,
                out=out,
                config={**pretrained, **config},
                per_request_bytes=per_request,
                thaw=thaw,
                notes=sys.stderr,
                on_progress=hashing,
            )
        elif src.is_dir() and _checkpoints(src, args):
            # Tensors only, converted into a staging copy: the source stays as it is.
            import tempfile

            from runtime.bundles.convert import stage_tree

            out = Path(args.out) if args.out else default_dir() / args.name
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".thaw-build-", dir=out.parent) as tmp:
                staged = stage_tree(src, Path(tmp), sys.stderr)
                manifest = build_bundle(
                    Path(tmp),
                    args.name,
                    version=args.version,
                    out=out,
                    config={**staged, **config},
                    per_request_bytes=per_request or 0,
                    on_progress=hashing,
                    thaw=thaw,
                )
        else:
            out = Path(args.out) if args.out else None
            manifest = build_bundle(
                src,
                args.name,
                version=args.version,
                out=out,
                config=config,
                per_request_bytes=per_request or 0,
                on_progress=hashing,
                thaw=thaw,
            )
    if not manifest.per_request_bytes and args.per_request_bytes is None:
        print(
            "thaw: warning: no --per-request-bytes and none estimated: admission reserves "
            f"the weights' {manifest.weights_bytes} bytes and nothing per request, so "
            "concurrent requests are not limited by memory",
            file=sys.stderr,
        )
    print_bundle("built", manifest, out if out is not None else src, args.json)
    return 0


def _checkpoints(src: Path, args: argparse.Namespace) -> bool:
    """Whether source directory `src` holds .pth/.pt files to convert; refused, with
    the exact command that converts them, unless --convert-pth asks for it."""
    from runtime.bundles.convert import checkpoints_in

    found = checkpoints_in(src)
    if found and not args.convert_pth:
        import shlex

        command = f"thaw bundle build {shlex.quote(args.src)} --name {shlex.quote(args.name)}"
        raise BundleError(
            f"{found[0]}: a pickle-based checkpoint (a bundle holds safetensors only); "
            f"convert it as you build: {command} --convert-pth (tensors only, read with "
            "torch.load(weights_only=True))"
        )
    return bool(found)
