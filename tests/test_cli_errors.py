"""No user error ends in a traceback: every subcommand, given a bad input, prints
``mcf <command>: error: <what, where, what was expected>`` on stderr and exits 1 (the command failed)
or 2 (the command line is wrong); ``--debug`` / ``MCF_DEBUG=1`` show the traceback (mcf/_core/cli_errors.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import numpy as np
import pytest

from _vectors import mantle_file
from mcf.bucket.store import Bucket
from mcf.cli import main
from _entry_point import mcf_command

CTX = "ctx_" + "0" * 32


@pytest.fixture
def paths(tmp_path):
    """Placeholders the cases below use: a missing path, a text file, an empty directory, a real MCF file,
    an empty bucket, a jsonl file, output paths, a port nobody listens on and one that is taken."""
    (tmp_path / "t.txt").write_text("hello\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "in.jsonl").write_text('{"text": "a document"}\n')
    Bucket(tmp_path / "bucket", create=True)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    yield {"missing": str(tmp_path / "missing"), "text": str(tmp_path / "t.txt"), "dir": str(tmp_path / "dir"),
           "mcf": mantle_file("f32"), "bucket": str(tmp_path / "bucket"), "jsonl": str(tmp_path / "in.jsonl"),
           "out": str(tmp_path / "out"), "out_mcf": str(tmp_path / "out.mcf"), "tree": str(tmp_path / "tree"),
           "busy_port": str(busy.getsockname()[1]), "closed_port": str(closed_port)}
    busy.close()


# (argv, exit code, what stderr must say); {name} is replaced with paths[name]
CASES = [
    ([], 2, "mcf: error: the following arguments are required: COMMAND"),
    (["bogus"], 2, "mcf: error: argument COMMAND: invalid choice: 'bogus'"),
    (["info"], 2, "mcf info: error: the following arguments are required: file"),
    (["info", "{missing}"], 1, "mcf info: error: {missing}: No such file or directory"),
    (["info", "{text}"], 1, "mcf info: error: {text}: header at offset 0: file shorter than the MCF header "
                            "(expected >= 40 bytes, got 6 bytes)"),
    # a directory is read as a safetensors checkpoint, as the loaders read one
    (["info", "{dir}"], 1, "mcf info: error: {dir}: no model.safetensors, shard index or *.safetensors"),
    (["verify", "{missing}"], 1, "mcf verify: error: {missing}: No such file or directory"),
    (["pack", "{missing}", "-o", "{out_mcf}"], 1, "mcf pack: error: {missing}: No such file or directory"),
    (["pack", "{dir}", "-o", "{out_mcf}"], 1, "mcf pack: error: {dir}: no model.safetensors, shard index or "
                                              "*.safetensors"),
    (["pack", "{dir}", "-o", "{out_mcf}", "--align", "x"], 2, "mcf pack: error: argument --align: invalid int"),
    (["quantize", "{missing}", "{out_mcf}"], 1, "mcf quantize: error: {missing}: No such file or directory"),
    (["quantize", "{mcf}", "{out_mcf}", "--min-clip", "1"], 2,
     "mcf quantize: error: --min-clip and --max-clip go together"),
    (["quantize", "{mcf}", "{out_mcf}", "--override", "embed*"], 1,
     "mcf quantize: error: override 'embed*' is not PATTERN=METHOD"),
    (["quantize", "{mcf}", "{out_mcf}", "--method", "k9"], 2, "mcf quantize: error: argument --method: invalid choice"),
    (["quantize", "{mcf}", "{out_mcf}", "--imatrix", "{missing}", "--fast"], 2,
     "mcf quantize: error: --imatrix weights the error-minimizing search; it does not apply with --fast"),
    (["imatrix", "{missing}", "--text", "{text}", "-o", "{out_mcf}"], 1,
     "mcf imatrix: error: {missing}: No such file or directory"),
    (["imatrix", "{mcf}", "--text", "{missing}", "-o", "{out_mcf}"], 1,
     "mcf imatrix: error: {missing}: No such file or directory"),
    (["convert", "{missing}", "-o", "{out_mcf}"], 1, "mcf convert: error: {missing}: No such file or directory"),
    (["convert", "{text}", "-o", "{out_mcf}"], 1, "mcf convert: error: {text}: a text file, not a checkpoint mcf "
                                                   "convert reads; pass a checkpoint directory"),
    (["export", "{missing}", "-o", "{out}"], 1, "mcf export: error: {missing}: No such file or directory"),
    (["export", "{mcf}", "-o", "{out}", "--max-shard-size", "5XB"], 1,
     "mcf export: error: cannot read '5XB' as a size"),
    (["kernels", "--jsn"], 2, "mcf: error: unrecognized arguments: --jsn"),
    (["version", "--jsn"], 2, "mcf: error: unrecognized arguments: --jsn"),
    (["demo", "--model-dir", "{missing}"], 1, "mcf demo: error: {missing}: no such checkpoint directory"),
    (["megatron"], 2, "mcf megatron: error: the following arguments are required"),
    (["megatron", "info", "{missing}"], 1, "mcf megatron info: error: {missing}.idx: No such file or directory"),
    (["megatron", "verify", "{missing}"], 1, "mcf megatron verify: error: {missing}.idx: No such file or directory"),
    (["megatron", "merge", "{out}", "{missing}"], 1, "mcf megatron merge: error: {missing}.idx: No such file"),
    (["megatron", "tokenize", "{jsonl}", "--tokenizer", "{missing}", "--output-prefix", "{out}"], 1,
     "mcf megatron tokenize: error: no tokenizer file at {missing}"),
    (["megatron", "tokenize", "{jsonl}", "--tokenizer", "{text}", "--output-prefix", "{out}"], 1,
     "mcf megatron tokenize: error: {text}: not a tokenizers file"),
    (["megatron", "tokenize", "{jsonl}", "--output-prefix", "{out}"], 2,
     "mcf megatron tokenize: error: the following arguments are required: --tokenizer"),
    (["ctx", "info", "{missing}"], 1, "mcf ctx info: error: {missing}: no such tree directory"),
    (["ctx", "verify", "{text}"], 1, "mcf ctx verify: error: {text}: not a directory"),
    (["ctx", "verify", "{missing}"], 1, "mcf ctx verify: error: {missing}: no such tree directory"),
    (["ctx", "ingest", "{tree}", "{text}"], 1, "mcf ctx ingest: error: text input needs --model-dir"),
    (["ctx", "ingest", "{tree}", "{text}", "--ids", "--embedding-dim", "8"], 1,
     "mcf ctx ingest: error: {text}: not a whole number of uint32 ids"),
    (["ctx", "snapshot", "{missing}"], 1, "mcf ctx snapshot: error: {missing}: no such tree directory"),
    (["ctx", "restore", "{missing}", "{tree}"], 1, "mcf ctx restore: error: {missing}: no such tree directory"),
    (["bucket", "ls", "--root", "{missing}"], 1, "mcf bucket ls: error: {missing}: is not a bucket"),
    (["bucket", "show", "--root", "{bucket}", "../../etc/passwd"], 1, "mcf bucket show: error: invalid context id"),
    (["bucket", "ingest", "--root", "{bucket}", "m", "{text}", "--text", "x"], 1,
     "mcf bucket ingest: error: {text}: not a zip archive (.npz)"),
    (["bucket", "ingest", "--root", "{bucket}", "m", "{missing}", "--text", "x", "--tokens", "{text}"], 2,
     "mcf bucket ingest: error: argument --tokens: not allowed with argument --text"),
    (["bucket", "rm", "--root", "{bucket}", CTX], 1, "mcf bucket rm: error: no context"),
    (["bucket", "promote", "--root", "{bucket}", CTX], 1, "mcf bucket promote: error: no context"),
    (["bucket", "promote", "--url", "http://127.0.0.1:{closed_port}", CTX], 1,
     "mcf bucket promote: error: http://127.0.0.1:{closed_port}/mcrp/v1/contexts/" + CTX + "/promote: cannot reach "
     "the server"),
    (["bucket", "demote", "--root", "{bucket}", CTX], 1, "mcf bucket demote: error: no context"),
    (["bucket", "gc", "--root", "{missing}"], 1, "mcf bucket gc: error: {missing}: is not a bucket"),
    (["bucket", "rebuild", "--root", "{missing}"], 1, "mcf bucket rebuild: error: {missing}: is not a bucket"),
    (["bucket", "verify", "--root", "{bucket}", CTX], 1, "mcf bucket verify: error: no context"),
    (["bucket", "serve", "--root", "{bucket}", "--port", "99999"], 2,
     "mcf bucket serve: error: argument --port: port 99999 is outside 0..65535"),
    (["bucket", "serve", "--root", "{bucket}", "--port", "{busy_port}"], 1,
     "mcf bucket serve: error: 127.0.0.1:{busy_port}: cannot listen there: Address already in use"),
]


def _run(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


@pytest.mark.parametrize("argv,code,message", CASES, ids=[" ".join(c[0])[:60] or "(none)" for c in CASES])
def test_bad_input_gives_one_line_and_an_exit_code(paths, capsys, argv, code, message):
    argv = [a.format(**paths) for a in argv]
    assert _run(argv) == code
    out, err = capsys.readouterr()
    assert message.format(**paths) in err, err
    assert "Traceback" not in err and "Traceback" not in out
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith(("mcf: error:", "mcf " + (argv[0] if argv else "")))
    assert ": error: " in lines[-1]


def _wrong_inputs(d):
    """(file, what convert must say it is, the command it must point to) for files users hand to
    ``mcf convert`` by mistake."""
    import gzip
    import pickle

    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    (d / "config.json").write_text('{"model_type": "bert"}')
    np.savez(d / "kv.npz", k=np.zeros(2))
    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=2))
    (d / "model.safetensors.gz").write_bytes(gzip.compress(b"\0" * 64))
    return [
        (mantle_file("k4"), "an MCF model container", "mcf quantize " + mantle_file("k4") + " OUT.mcf --method k4"),
        (str(d / "config.json"), "a JSON file", "pass the checkpoint directory that holds it"),
        (os.path.join(fixtures, "megatron", "megatron_u16.idx"), "the index (.idx) of a Megatron indexed dataset",
         "mcf megatron info"),
        (os.path.join(fixtures, "megacontext", "canonical_fp16", "LOD2.ctx"), "a level file (LOD*.ctx) of a "
         "MegaContext tree", "mcf ctx info"),
        (os.path.join(fixtures, "bucket", "float16_lz4.mcb"), "a KV-cache file (kv_data.mcb) of a Model Context Bucket",
         "mcf bucket verify"),
        (str(d / "kv.npz"), "a zip archive", "save the weights as safetensors first"),
        (str(d / "pytorch_model.bin"), "a Python pickle", "save the weights as safetensors first"),
        (str(d / "model.safetensors.gz"), "a gzip-compressed file", "decompress it first"),
    ]


def test_convert_says_what_a_wrong_input_is_and_which_command_reads_it(tmp_path, capsys):
    """``mcf convert model.mcf`` said "header_len at offset 0: header length too large (expected
    <= ..., got 281479276282701)".  Any file of a kind mcf knows is named, with the command that reads it."""
    import mcf

    for path, what, command in _wrong_inputs(tmp_path):
        out = tmp_path / "out.mcf"
        assert main(["convert", path, "-o", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"mcf convert: error: {path}: {what}"), err
        assert command in err and "(expected a checkpoint directory, a .safetensors or a .gguf file)" in err, err
        assert "header_len" not in err and not out.exists()
        with pytest.raises(mcf.FormatError, match="not a checkpoint mcf convert reads"):
            mcf.convert(path, str(out))
    # what convert does read converts by its bytes, whatever its name says
    shutil.copy(os.path.join(os.path.dirname(__file__), "fixtures", "gguf", "golden_v3.gguf"),
                tmp_path / "model.safetensors")
    assert main(["convert", str(tmp_path / "model.safetensors"), "-o", str(tmp_path / "g.mcf"), "-q"]) == 0
    mcf.convert(os.path.join(os.path.dirname(__file__), "fixtures", "gguf", "golden_v3.gguf"), str(tmp_path / "h.mcf"))
    with mcf.open(str(tmp_path / "g.mcf")) as a, mcf.open(str(tmp_path / "h.mcf")) as b:
        assert list(a) == list(b) and len(a) > 0
    st = tmp_path / "model.gguf"
    mcf.export(mantle_file("f32"), str(st), resources=False)  # a safetensors file named .gguf
    assert main(["convert", str(st), "-o", str(tmp_path / "s.mcf"), "-q"]) == 0


def test_every_subcommand_has_a_bad_input_case():
    """A new subcommand must come with a case above."""
    from mcf.cli import build_parser

    import argparse

    def commands(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                        yield from commands(sub, prefix + [name])
                    else:
                        yield tuple(prefix + [name])

    tested = {tuple(argv[:2]) if argv and argv[0] in ("megatron", "ctx", "bucket") else tuple(argv[:1])
              for argv, _, _ in CASES}
    missing = set(commands(build_parser(), [])) - tested
    assert not missing, f"subcommands without a bad-input case: {sorted(missing)}"


def test_invalid_forced_kernel_variant_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("MCF_FORCE_IMPL", "avx3")
    assert main(["kernels"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == ("mcf kernels: error: MCF_FORCE_IMPL='avx3': unknown kernel variant "
                           "(expected one of scalar, avx2, avx512, neon)")
    monkeypatch.setenv("MCF_FORCE_IMPL", "scalar")
    assert main(["kernels"]) == 0
    assert "active: scalar" in capsys.readouterr().out


def test_a_variant_of_the_other_architecture_is_refused(monkeypatch, capsys):
    """neon on x86-64, avx2 on aarch64: a known variant this CPU cannot run exits 2 and says what it can."""
    import platform

    from mcf._core._kernels import kernel_info

    other = "neon" if platform.machine() in ("x86_64", "AMD64") else "avx2"
    supported = kernel_info()["supported"]
    assert other not in supported
    monkeypatch.setenv("MCF_FORCE_IMPL", other)
    assert main(["kernels"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (f"mcf kernels: error: MCF_FORCE_IMPL='{other}': this CPU cannot run that kernel variant "
                           f"(it supports {', '.join(supported)})")


def test_a_bug_is_called_one_and_points_at_debug(monkeypatch, capsys):
    import mcf.cli

    def boom(args):
        raise TypeError("something mcf did not expect")

    monkeypatch.setattr(mcf.cli, "cmd_info", boom)
    assert main(["info", "x"]) == 1
    err = capsys.readouterr().err
    assert "mcf info: internal error: TypeError: something mcf did not expect" in err
    assert "--debug" in err and "Traceback" not in err
    with pytest.raises(TypeError):
        main(["info", "x", "--debug"])


def _mcf():
    return mcf_command()


def test_entry_point_debug_flag_and_environment(tmp_path):
    """Run as a user runs it: the installed console script, the environment variable, --debug anywhere."""
    missing = str(tmp_path / "missing.mcf")
    env = {k: v for k, v in os.environ.items() if k not in ("MCF_DEBUG", "MCF_FORCE_IMPL")}
    r = subprocess.run(_mcf() + ["info", missing], capture_output=True, text=True, env=env, check=False)
    assert (r.returncode, r.stderr) == (1, f"mcf info: error: {missing}: No such file or directory\n")
    r = subprocess.run(_mcf() + ["kernels"], capture_output=True, text=True, env={**env, "MCF_FORCE_IMPL": "avx3"},
                       check=False)
    assert r.returncode == 2 and r.stdout == "" and "mcf kernels: error: MCF_FORCE_IMPL='avx3'" in r.stderr
    for argv, extra_env in ((["--debug", "info", missing], {}), (["info", missing, "--debug"], {}),
                            (["info", missing], {"MCF_DEBUG": "1"})):
        r = subprocess.run(_mcf() + argv, capture_output=True, text=True, env={**env, **extra_env}, check=False)
        assert r.returncode == 1 and "Traceback" in r.stderr and "MissingFileError" in r.stderr, (argv, r.stderr)
    # after "--", --debug is an argument (here a file name), not the flag
    r = subprocess.run(_mcf() + ["info", "--", "--debug"], capture_output=True, text=True, env=env, check=False)
    assert (r.returncode, r.stderr) == (1, "mcf info: error: --debug: No such file or directory\n")


def test_a_closed_pipe_is_not_an_error_message(tmp_path):
    """``mcf info big.mcf | head -1``: the reader leaves early; no BrokenPipeError traceback."""
    big = tmp_path / "big.mcf"
    import mcf

    with mcf.Writer(str(big)) as w:
        for i in range(3000):
            w.add_tensor(f"tensor.{i:05d}.weight", np.zeros(4, np.float32))
    with subprocess.Popen(_mcf() + ["info", str(big)], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        p.stdout.close()  # before the process has written anything: its first write gets EPIPE
        err = p.stderr.read().decode()
        p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
