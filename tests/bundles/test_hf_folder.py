"""A Hugging Face `save_pretrained` folder is a bundle as it is: `thaw bundle build DIR
--name N` (no --config) gives the builder config.json as `config` and the tokenizer
and other files as `files`; served through real handlers (docs/transformers.md's
recipe, tests/handlers/transformers_auto.py), the answers equal transformers' own
in this process. Pickle is still refused."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runtime.bundles.manifest import read_manifest
from runtime.bundles.pretrained import pretrained_request_bytes
from runtime.cli.main import main
from tests.inproc import serving, settings_for

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
HANDLERS = ("tests.handlers.transformers_auto",)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "thaw", "me"]
TOLERANCE = 1e-5


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def thaw(*args: str, cwd: Path) -> Ran:
    """`thaw ARGS` run in this process (the command's own code, its streams captured)
    from directory `cwd`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return Ran(code, out.getvalue(), err.getvalue())


def save_bert(folder: Path) -> None:
    """A tiny random BertModel and a WordPiece tokenizer, one safetensors file."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(folder)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n")
    BertTokenizer(str(vocab)).save_pretrained(folder)


def save_llama(folder: Path) -> None:
    """A tiny random LlamaForCausalLM in several shards (max_shard_size), a word-level
    fast tokenizer, generation_config.json."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="20KB")
    words = ["<unk>", "<s>", "</s>", "hello", "world", "thaw", "me"]
    model = models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast: Any = PreTrainedTokenizerFast  # untyped
    fast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both folders saved, then bundled by the real command: the sharded one with no
    --out (bundles/NAME of the working directory), neither with --config."""
    root = tmp_path_factory.mktemp("hf")
    save_bert(root / "bert")
    save_llama(root / "llama")
    bert = thaw(
        "bundle",
        "build",
        str(root / "bert"),
        "--name",
        "tiny-bert",
        "--out",
        str(root / "bundles" / "tiny-bert"),
        cwd=root,
    )
    llama = thaw("bundle", "build", str(root / "llama"), "--name", "tiny-llama", cwd=root)
    return {"root": root, "bert": bert, "llama": llama}


def max_abs_diff(a: Any, b: Any) -> float:
    import torch

    return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())


def test_the_bundle_holds_config_json_as_config_and_every_other_file(
    built: dict[str, Any],
) -> None:
    root = built["root"]
    for name, folder in (("tiny-bert", "bert"), ("tiny-llama", "llama")):
        result = built["bert" if folder == "bert" else "llama"]
        assert result.returncode == 0, result.stderr
        bundle_dir = root / "bundles" / name
        verified = thaw("bundle", "verify", str(bundle_dir), cwd=root)
        assert verified.returncode == 0, verified.stderr
        manifest = read_manifest(bundle_dir)
        source = json.loads((root / folder / "config.json").read_text())
        assert manifest.config == source  # verbatim: its own "dtype" key included
        assert "dtype" in source and manifest.load_dtype is None
        # Every file of the folder, and nothing else.
        saved = {p.name for p in (root / folder).iterdir()}
        assert {f.path for f in manifest.files} == saved
        # An estimate from config.json, said on stderr.
        assert manifest.per_request_bytes == pretrained_request_bytes(source) > 0
        assert "per-request memory estimated from config.json" in result.stderr
    llama = read_manifest(root / "bundles" / "tiny-llama")
    shards = [f.path for f in llama.files if f.path.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in {f.path for f in llama.files}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        f.path for f in llama.files
    }


@pytest.mark.anyio
async def test_the_builder_gets_config_and_files(built: dict[str, Any], tmp_path: Path) -> None:
    root = built["root"]
    result = thaw(
        "bundle",
        "build",
        str(root / "bert"),
        "--name",
        "builder-args",
        "--out",
        str(tmp_path / "bundles" / "builder-args"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    settings = settings_for(tmp_path, handlers=HANDLERS)
    async with serving(settings) as served:
        response = await served.client.post("/invoke/builder_args", json={})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["config"] == json.loads((root / "bert" / "config.json").read_text())
    files = answer["files"]
    assert {"vocab.txt", "tokenizer.json", "tokenizer_config.json", "config.json"} <= set(files)
    assert Path(files["vocab.txt"]).read_text() == (root / "bert" / "vocab.txt").read_text()


@pytest.mark.anyio
async def test_outputs_equal_transformers_in_process(built: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    root = built["root"]
    texts = ["hello world", "thaw me hello"]
    prompt = "hello thaw world"
    settings = settings_for(root, handlers=HANDLERS)
    async with serving(settings) as served:
        encoded = await served.client.post("/invoke/encode", json={"texts": texts})
        completed = await served.client.post(
            "/invoke/complete", json={"text": prompt, "max_new_tokens": 6}
        )
    assert encoded.status_code == 200, encoded.text
    assert completed.status_code == 200, completed.text

    with torch.inference_mode():
        bert = AutoModel.from_pretrained(root / "bert").eval()
        inputs = AutoTokenizer.from_pretrained(root / "bert")(
            texts, return_tensors="pt", padding=True
        )
        expected = bert(**inputs).last_hidden_state
        assert max_abs_diff(encoded.json()["last_hidden_state"], expected) <= TOLERANCE

        llama: Any = AutoModelForCausalLM.from_pretrained(root / "llama")
        llama.eval()
        inputs = AutoTokenizer.from_pretrained(root / "llama")(prompt, return_tensors="pt")
        logits = llama(**inputs).logits[0, -1]
        tokens = llama.generate(**inputs, max_new_tokens=6, do_sample=False)
    answer = completed.json()
    assert max_abs_diff(answer["logits"], logits) <= TOLERANCE
    assert answer["tokens"] == tokens[0, inputs["input_ids"].shape[1] :].tolist()


def test_the_docs_recipe_is_the_tested_handler() -> None:
    source = (ROOT / "tests" / "handlers" / "transformers_auto.py").read_text()
    begin, end = "# --- docs/transformers.md: begin ---\n", "# --- docs/transformers.md: end ---"
    recipe = source[source.index(begin) + len(begin) : source.index(end)].strip()
    page = (ROOT / "docs" / "transformers.md").read_text()
    assert recipe in page


def test_a_folder_of_pickle_weights_only_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    (folder / "vocab.txt").write_text("[PAD]\n")
    result = thaw("bundle", "build", str(folder), "--name", "old", cwd=tmp_path)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "pytorch_model.bin: a pickle-based checkpoint" in line
    assert "safe_serialization=True" in line
    assert not (tmp_path / "bundles" / "old" / "bundle.json").exists()


def test_a_pickle_beside_safetensors_is_left_out_with_a_note(
    built: dict[str, Any], tmp_path: Path
) -> None:
    import shutil

    folder = tmp_path / "both"
    shutil.copytree(built["root"] / "bert", folder)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    (folder / "optimizer.pt").write_bytes(b"\x80\x04pickle")  # a Trainer checkpoint's
    (folder / "README.md").write_text("# a model card\n")
    result = thaw("bundle", "build", str(folder), "--name", "both", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "pytorch_model.bin left out: a pickle-based file" in result.stderr
    assert "README.md left out" in result.stderr
    assert "optimizer.pt left out: a pickle-based file" in result.stderr
    paths = {f.path for f in read_manifest(tmp_path / "bundles" / "both").files}
    assert "pytorch_model.bin" not in paths and "model.safetensors" in paths


def test_dtype_goes_to_thaw_settings_not_the_config(built: dict[str, Any], tmp_path: Path) -> None:
    result = thaw(
        "bundle",
        "build",
        str(built["root"] / "bert"),
        "--name",
        "half",
        "--dtype",
        "float16",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(tmp_path / "bundles" / "half")
    assert manifest.thaw == {"dtype": "float16"} and manifest.load_dtype == "float16"
    assert manifest.config["dtype"] == "float32"  # the model's own key, untouched


def test_thaw_invoke_answers_as_transformers_does(
    built: dict[str, Any], thaw_env: dict[str, str]
) -> None:
    """The command a user runs first, as a process: stdout is the answer alone (what
    transformers prints while the builder runs goes to stderr)."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModel, AutoTokenizer

    root = built["root"]
    env = {**thaw_env, "THAW_HANDLERS": HANDLERS[0], "THAW_BUNDLE_SOURCE": str(root / "bundles")}
    texts = ["hello thaw", "world"]
    event = json.dumps({"texts": texts})
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "invoke", "encode", "--event", event],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    with torch.inference_mode():
        bert = AutoModel.from_pretrained(root / "bert").eval()
        inputs = AutoTokenizer.from_pretrained(root / "bert")(
            texts, return_tensors="pt", padding=True
        )
        expected = bert(**inputs).last_hidden_state
    assert max_abs_diff(answer["last_hidden_state"], expected) <= TOLERANCE
