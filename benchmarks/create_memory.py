"""Host memory of creating and loading a model split: peak RSS against the shards it makes.

    python benchmarks/create_memory.py            # ~2 min on 2 cores; writes RESULTS.md

Each measurement runs in a fresh process on 8 emulated CPU devices (device memory is host
memory there, so RSS counts every device's shards): the peak resident set
(``getrusage`` ``ru_maxrss``) after the step, minus the resident set just before it, is
set against the bytes of the shards the step leaves on the devices (all 8 devices'
shards: the total the process must hold). The model is
``TinyLlama(vocab=16384, width=1024, heads=16, kv_heads=8, layers=4)`` laid out tensor-
parallel over ``mp`` 8 by ``to_distributed`` (so every device holds 1/8 of each split
parameter and the shards sum to about the whole model once):

- ``built, then placed``: ``to_distributed(model)``, the model built eagerly on device 0;
- ``created split``: ``to_distributed(factory)`` (:mod:`jfleet.mesh.create`);
- ``load_model``: a jfleet checkpoint (Orbax) read into the created model;
- ``load_safetensors``: the same weights as a Hugging Face directory (LLAMA_HF), read
  slice by slice into the created model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 2**20
SHAPE = dict(vocab=16384, width=1024, heads=16, kv_heads=8, layers=4)
STEPS = ("built, then placed", "created split", "load_model", "load_safetensors")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(step: str, where: Path) -> dict:
    """One step in this (fresh) process: RSS before, peak after, the shards it made."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import optax
    from flax import nnx

    from jfleet import ToDistributedConfig, to_distributed
    from jfleet.checkpoint.hf_weights import LLAMA_HF, load_safetensors
    from jfleet.checkpoint.state_dict import load_model
    from jfleet.models import lm_batches
    from jfleet.models.llama import TinyLlama

    def factory():
        return TinyLlama(**SHAPE)

    config = ToDistributedConfig(force_mesh={"mp": 8})
    batches = lm_batches(1, vocab=SHAPE["vocab"])
    device = None
    if step == "built, then placed":
        model = factory()
        jax.block_until_ready(nnx.state(model))
        del model  # the build is the user's; what is measured is build + place below
        before = _rss()
        model, _, _ = to_distributed(factory(), optax.sgd(0.1), batches, config=config)
    else:
        if step != "created split":
            model, _, _ = to_distributed(factory, optax.sgd(0.1), batches, config=config)
        before = _rss()
        if step == "created split":
            from jfleet.mesh import create

            program, programs = create._program, []

            def measured(fn, out_shardings):  # each creation program's compiled memory
                compiled = program(fn, out_shardings)
                programs.append(compiled.memory_analysis())
                return compiled

            create._program = measured
            model, _, _ = to_distributed(factory, optax.sgd(0.1), batches, config=config)
            create._program = program
            device = max(m.output_size_in_bytes + m.temp_size_in_bytes for m in programs)
        elif step == "load_model":
            load_model(where / "jfleet", model)
        else:
            load_safetensors(where / "hf", model, LLAMA_HF)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    jax.block_until_ready(leaves)
    shards = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    whole = sum(x.nbytes for x in leaves)
    largest = max(x.nbytes for x in leaves)
    del np
    if step == "built, then placed":
        device = whole + max(s.data.nbytes for x in leaves for s in x.addressable_shards[:1])
    return dict(
        step=step, before=before, peak=_peak(), shards=shards, whole=whole, largest=largest,
        device=device,
    )  # fmt: skip


def write_files(where: Path) -> None:
    """The weights both loaders read: a jfleet checkpoint and a Hugging Face directory."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from safetensors.numpy import save_file

    from jfleet.checkpoint.layout import logical_leaves
    from jfleet.checkpoint.state_dict import save_model
    from jfleet.models.llama import TinyLlama

    model = TinyLlama(**SHAPE, seed=1)
    save_model(where / "jfleet", model)
    tensors = {}
    for key, value in logical_leaves(model, model).items():
        value = np.asarray(value)
        if key == "embed_tokens.embedding":
            tensors["model.embed_tokens.weight"] = value
        elif key == "lm_head":
            tensors["lm_head.weight"] = np.ascontiguousarray(value.T)
        elif key == "norm.scale":
            tensors["model.norm.weight"] = value
        elif key.endswith(".kernel"):
            tensors["model." + key[: -len("kernel")] + "weight"] = np.ascontiguousarray(value.T)
        else:
            tensors["model." + key[: -len("scale")] + "weight"] = value
    (where / "hf").mkdir()
    save_file(tensors, where / "hf" / "model.safetensors")


def _child(args: list[str]) -> dict | None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    )
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{out.stdout}\n{out.stderr}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def report(rows: list[dict]) -> str:
    from benchmarks.results_file import environment

    whole = rows[0]["whole"]
    lines = [
        "# Creating and loading a model split: host memory",
        "",
        *environment("python benchmarks/create_memory.py"),
        f"- model: `TinyLlama({', '.join(f'{k}={v}' for k, v in SHAPE.items())})`, "
        f"{whole / MiB:.1f} MiB of fp32 parameters, the largest tensor "
        f"{rows[0]['largest'] / MiB:.1f} MiB; `to_distributed(..., force_mesh={{'mp': 8}})`",
        "- growth: peak RSS after the step minus RSS just before it (one fresh process per "
        "row); shards: the parameters' bytes on all 8 devices after it",
        "",
        "| step | host growth (MiB) | shards made (MiB) | growth / shards "
        "| peak on one device (MiB) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        growth = r["peak"] - r["before"]
        made = r["shards"] if r["step"] in STEPS[:2] else 0
        ratio = f"{growth / made:.2f}" if made else "-"
        device = f"{r['device'] / MiB:.1f}" if r["device"] else "-"
        lines.append(
            f"| {r['step']} | {growth / MiB:.1f} | {made / MiB:.1f} | {ratio} | {device} |"
        )
    lines += [
        "",
        "Peak on one device: built, then placed, device 0 holds the whole model and its own "
        "shard (the whole model's bytes plus one shard: counted, CPU devices report no "
        "memory); created split, the largest creation program's compiled output + temp per "
        "device (`memory_analysis()`, measured). That is what decides whether a model fits "
        "its devices. On 8 emulated devices all devices share one host, so the host growth "
        "adds every device's share: creating split, one program holds the threefry scratch "
        f"of every initialiser at once (per device, the peak above less its "
        f"{rows[1]['shards'] / 8 / MiB:.0f} MiB of shards) and XLA compiles it, more than "
        "building eagerly, one initialiser at a time, keeps beside the whole model at this "
        "size. Loading writes into the existing shards: "
        "`load_safetensors` reads through a memory map, whose touched file pages count in "
        "RSS (the file is 272 MiB here), beside the slices of one tensor at a time; "
        "`load_model` is Orbax's restore, its buffers and tensorstore's cache.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step", choices=STEPS)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="RESULTS.md to write")
    args = parser.parse_args(argv)
    if args.write:
        write_files(args.dir)
        return 0
    if args.step:
        print(json.dumps(measure(args.step, args.dir)))
        return 0
    where = Path(tempfile.mkdtemp(prefix="jfleet-create-memory-"))
    _child(["--write", "--dir", str(where)])
    rows = [_child(["--step", step, "--dir", str(where)]) for step in STEPS]
    text = report(rows)
    print(text)
    from benchmarks.results_file import write_section

    write_section("create_memory", text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
