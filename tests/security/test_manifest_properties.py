"""The manifest parser on arbitrary input: a Manifest or BundleError, nothing else;
and what it accepts round-trips through its canonical form."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.bundles.manifest import Manifest, parse_manifest
from runtime.errors import BundleError

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# A valid manifest, then up to two mutations: a field replaced by a near miss or by
# arbitrary JSON, or deleted. Unmutated draws are valid, so the round-trip property
# is exercised; mutated ones reach every check of the parser.
segments = st.text("abcxyz019_", min_size=1, max_size=6)
valid_paths = st.builds(
    lambda parts, suffix: "/".join(parts) + suffix,
    st.lists(segments, min_size=1, max_size=3),
    st.sampled_from([".safetensors", ".json", ".txt"]),
)
valid_files = st.fixed_dictionaries(
    {
        "path": valid_paths,
        "size": st.integers(min_value=0, max_value=2**40),
        "sha256": st.binary(min_size=32, max_size=32).map(bytes.hex),
    }
)
valid_manifests = st.fixed_dictionaries(
    {
        "format": st.just(1),
        "name": st.builds(str.__add__, st.sampled_from("a0z9"), st.text("abz09._-", max_size=20)),
        "version": st.text(min_size=1, max_size=20),
        "files": st.lists(valid_files, min_size=1, max_size=3, unique_by=lambda f: f["path"]),
    },
    optional={
        "config": st.dictionaries(st.text(max_size=6), json_values, max_size=3),
        "memory": st.fixed_dictionaries(
            {},
            optional={
                "weights_bytes": st.integers(min_value=0, max_value=2**40),
                "per_request_bytes": st.integers(min_value=0, max_value=2**40),
            },
        ),
    },
)
DELETE = object()
WHERE: list[tuple[str | int, ...]] = [
    ("format",),
    ("name",),
    ("version",),
    ("files",),
    ("config",),
    ("memory",),
    ("extra",),
    ("memory", "weights_bytes"),
    ("memory", "per_request_bytes"),
    ("memory", "extra"),
    ("files", 0, "path"),
    ("files", 0, "size"),
    ("files", 0, "sha256"),
    ("files", 0, "extra"),
    ("files", 0),
]
near_misses = st.sampled_from(
    [
        DELETE,
        2,
        True,
        1.0,
        "1",
        "",
        -1,
        2**64 - 1,
        None,
        [],
        {},
        "A" * 64,
        "0" * 63,
        "../x.txt",
        "/abs.txt",
        "m.bin",
        "m.pt",
        "bundle.json",
        "a//b.txt",
        "a\\b.txt",
        "a\x00.txt",
        "x.gguf",
        "Bad",
        "-x",
        "a" * 65,
        "v" * 129,
    ]
)
mutations = st.lists(st.tuples(st.sampled_from(WHERE), near_misses | json_values), max_size=2)


def mutate(data: dict[str, Any], changes: list[tuple[tuple[str | int, ...], Any]]) -> None:
    """Apply each change where its path still leads (an earlier one may have cut it)."""
    for where, value in changes:
        *steps, last = where
        parent: Any = data
        for step in steps:
            if isinstance(parent, dict) and isinstance(step, str):
                parent = parent.get(step)
            elif isinstance(parent, list) and isinstance(step, int) and step < len(parent):
                parent = parent[step]
            else:
                parent = None
        if isinstance(parent, dict) and isinstance(last, str):
            if value is DELETE:
                parent.pop(last, None)
            else:
                parent[last] = value
        elif isinstance(parent, list) and isinstance(last, int) and last < len(parent):
            if value is DELETE:
                del parent[last]
            else:
                parent[last] = value


def parse_or_refuse(raw: bytes) -> Manifest | None:
    try:
        manifest = parse_manifest(raw)
    except BundleError:
        return None
    assert isinstance(manifest, Manifest)
    return manifest


@PROPERTY
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_give_a_manifest_or_bundle_error(raw: bytes) -> None:
    parse_or_refuse(raw)


@PROPERTY
@given(json_values)
def test_arbitrary_json_gives_a_manifest_or_bundle_error(value: Any) -> None:
    parse_or_refuse(orjson.dumps(value))


@PROPERTY
@given(valid_manifests, mutations)
def test_mutated_manifests_parse_or_are_refused_and_what_parses_round_trips(
    data: dict[str, Any], changes: list[tuple[tuple[str | int, ...], Any]]
) -> None:
    mutate(data, changes)
    manifest = parse_or_refuse(orjson.dumps(data))
    if not changes:
        assert manifest is not None, data
    if manifest is None:
        return
    again = parse_manifest(manifest.canonical())
    assert again == manifest and again.id == manifest.id
    for f in manifest.files:
        assert not f.path.startswith("/") and ".." not in f.path.split("/")
        assert f.size >= 0 and len(f.sha256) == 64
