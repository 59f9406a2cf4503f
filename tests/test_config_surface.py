"""The configuration surface of `slidetune train`: the user's flags in --help groups, the pipeline's
tuning knobs as one group (--tuning.NAME, a YAML `tuning:` section, "tuning" in config.json,
listed by --help-tuning), and the old top-level spellings of the knobs, which still work with a note."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re

import pytest

from slidetune import config as config_mod
from slidetune.cli import build_parser, main
from slidetune.config import (FLAG_GROUPS, TrainConfig, _leaf_fields, config_from_args, config_to_dict,
                              group_tuning, tuning_paths)
from slidetune.engine.config import (KNOB_SECTION, SECTIONS, ClipScheduleTuning, RuntimeConfig, cli_flag,
                                     runtime_fields, tuning_docs)


def parse(*args: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *args]))


def run_main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:          # argparse: --help, --help-tuning and usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def fresh_deprecation_notes(monkeypatch):
    """Each test sees the once-per-process deprecation notes as a new process would."""
    monkeypatch.setattr(config_mod, "_DEPRECATION_NOTED", set())


# ----------------------------------------------------------------------------- classification
def test_every_field_is_a_user_flag_or_a_tuning_knob():
    """A new RuntimeConfig (or TrainConfig) field must say what it is: a flag in one of config.FLAG_GROUPS,
    or a tuning knob declared with engine.config.tuning_field. Never both, never neither."""
    grouped = [p for _, paths in FLAG_GROUPS.values() for p in paths]
    assert len(grouped) == len(set(grouped)), "a field is in two --help groups"
    leaves = {p for p, _ in _leaf_fields(TrainConfig)}
    assert set(grouped) <= leaves, f"FLAG_GROUPS names fields that do not exist: {set(grouped) - leaves}"
    knobs = set(tuning_paths())
    for name in runtime_fields():
        path = f"runtime.{name}"
        assert (path in grouped) != (path in knobs), (
            f"RuntimeConfig.{name} is {'both' if path in knobs else 'neither'} a user flag and a tuning knob: "
            "add its path to a group of config.FLAG_GROUPS (a choice the user makes, e.g. memory) or declare "
            "it with tuning_field(default, help=..., when=...) (a pipeline knob with a measured default)")
    unclassified = leaves - set(grouped) - knobs
    assert not unclassified, f"fields in no --help group (config.FLAG_GROUPS): {sorted(unclassified)}"


def test_the_split_follows_the_issue():
    """User flags: model, data, batch, mode, memory (disk_dir), offload, compile, clipping; the
    pipeline's rings, chunks, streams, waits, order and the disk tier's sizes are knobs."""
    knobs = set(tuning_docs())
    for user in ("mode", "dtype", "device", "offload_activations", "compile_layers", "disk_dir"):
        assert user not in knobs
    for knob in ("cache_units", "chunk_mb", "upload_ring", "download_ring", "upload_cast_stream", "cast_on",
                 "cuda_waits", "gil_switch_ms", "update_order", "disk_units", "disk_master", "disk_block_mb",
                 "disk_buffers", "disk_io_threads"):
        assert knob in knobs
    assert "runtime.disk_dir" in FLAG_GROUPS["memory"][1]
    assert "max_grad_norm" in FLAG_GROUPS["clipping"][1]


def test_every_knob_documents_itself_in_one_line():
    for name, doc in tuning_docs().items():
        assert len(doc.help) > 15 and len(doc.when) > 15, name
        assert "\n" not in doc.help + doc.when, name
    assert cli_flag("chunk_mb") == "--tuning.chunk_mb" and cli_flag("offload_activations") == "--offload-activations"


# ----------------------------------------------------------------------------- --help and --help-tuning
def test_help_shows_user_flags_in_groups_and_no_knob():
    code, text, _ = run_main("train", "--help")
    assert code == 0
    for group in ("model", "data", "batch", "optimizer", "clipping", "mode", "memory", "offload", "compile",
                  "output"):
        assert re.search(rf"^{group}:$", text, flags=re.M), f"--help has no {group} group"
    memory = text.split("\nmemory:")[1].split("\noffload:")[0]
    assert "--disk-dir" in memory and "--check-memory" in memory
    assert "--help-tuning" in text and "--tuning.NAME" in text
    options = re.findall(r"^  (--[\w.-]+)", text, flags=re.M)      # the option entries, not the prose
    for name in tuning_docs():
        assert "--" + name.replace("_", "-") not in options and f"--tuning.{name}" not in options, name
    assert "--disk-dir" in options and "--max-grad-norm" in options


def test_help_tuning_lists_every_knob_with_default_and_when():
    code, text, _ = run_main("train", "--help-tuning")
    assert code == 0
    defaults = RuntimeConfig()
    for name, doc in tuning_docs().items():
        m = re.search(rf"^  --tuning\.{name} \S+ \(default: (.*)\)\n      (.*)\n      when: (.*)$", text, flags=re.M)
        assert m, f"--help-tuning lacks {name}"
        assert m[1] == str(defaults.setting(name)) and m[2] == doc.help and m[3] == doc.when
    assert "tuning:" in text                       # how to set them in YAML
    # plan takes the same flags
    code, text2, _ = run_main("plan", "--help-tuning")
    assert code == 0 and text2 == text


# ----------------------------------------------------------------------------- parsing and precedence
def test_tuning_flags_and_yaml_section_with_precedence(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("batch_size: 3\ntuning:\n  chunk_mb: 64\n  upload-ring: 6\n  gc_freeze: no\n"
                 "runtime: {offload_activations: true}\n")
    assert parse().runtime.transfer.chunk_mb == RuntimeConfig().transfer.chunk_mb                         # default
    cfg = parse("--config", str(f))                                                     # YAML over default
    t = cfg.runtime.transfer
    assert (t.chunk_mb, t.upload_ring, cfg.runtime.host.gc_freeze) == (64, 6, False)
    assert cfg.batch_size == 3 and cfg.runtime.offload_activations == "on"
    cfg = parse("--config", str(f), "--tuning.chunk_mb", "32", "--tuning.upload-ring=2", "--tuning.gc_freeze",
                "--batch-size", "5")                                                    # flags over YAML
    t = cfg.runtime.transfer
    assert (t.chunk_mb, t.upload_ring, cfg.runtime.host.gc_freeze, cfg.batch_size) == (32, 2, True, 5)
    assert cfg.runtime.transfer.upload_cast_stream == "copy"                                     # untouched: default
    assert parse("--tuning.disk_units", "0.5", "--disk-dir", str(tmp_path)).runtime.disk.disk_units == 0.5
    with pytest.raises(ValueError, match="gil_switch_ms"):                              # values still checked
        parse("--tuning.gil_switch_ms", "1000")


def test_unknown_tuning_knob_names_the_valid_ones(tmp_path):
    code, _, err = run_main("train", "--tuning.chunk_size", "64")
    assert code == 2
    assert "unknown tuning knob --tuning.chunk_size" in err and "chunk_mb" in err and "--help-tuning" in err
    assert all(name in err for name in tuning_docs())
    f = tmp_path / "bad.yaml"
    f.write_text("tuning: {chunk_size: 64}\n")
    code, _, err = run_main("train", "--config", str(f), "--output-dir", str(tmp_path / "never"))
    assert code == 2 and "chunk_size" in err and "chunk_mb" in err and "upload_ring" in err
    assert not (tmp_path / "never").exists()


def test_old_spellings_work_with_one_note(tmp_path, capsys):
    cfg = parse("--chunk-mb", "64", "--cast-on", "cpu", "--chunk-mb", "128")
    assert cfg.runtime.transfer.chunk_mb == 128 and cfg.runtime.transfer.cast_on == "cpu"
    parse("--chunk-mb", "32")                                     # a second parse in the same process
    err = capsys.readouterr().err
    assert err.count("--chunk-mb is deprecated") == 1 and "use --tuning.chunk_mb" in err
    assert err.count("--cast-on is deprecated") == 1 and "use --tuning.cast_on" in err
    parse("--tuning.chunk_mb", "64")
    assert capsys.readouterr().err == ""                          # the new spelling says nothing
    # YAML: flat keys and the runtime: section (a config.json from before the group) still load
    f = tmp_path / "old.yaml"
    f.write_text("chunk_mb: 64\nruntime: {upload_ring: 5, mode: slide}\n")
    cfg = parse("--config", str(f))
    assert cfg.runtime.transfer.chunk_mb == 64 and cfg.runtime.transfer.upload_ring == 5
    err = capsys.readouterr().err
    assert "chunk_mb" in err and "runtime.upload_ring" in err and "tuning:" in err and "deprecated" in err


# ----------------------------------------------------------------------------- config.json
def test_config_json_groups_the_knobs_and_reads_back(tmp_path):
    cfg = parse("--tuning.chunk_mb", "64", "--offload-activations", "--max-grad-norm", "0.5")
    saved = config_to_dict(cfg)
    assert list(saved).index("tuning") == list(saved).index("runtime") + 1
    assert set(saved["tuning"]) == set(tuning_docs()) and saved["tuning"]["chunk_mb"] == 64
    assert not set(saved["runtime"]) & set(tuning_docs()) and saved["runtime"]["offload_activations"] == "on"
    f = tmp_path / "config.json"
    f.write_text(json.dumps(saved))
    assert parse("--config", str(f)) == cfg                       # valid --config input, same config
    # one saved before the group (every knob under runtime) reads as the same grouping
    old = {**dataclasses.asdict(cfg), "runtime": cfg.runtime.to_flat()}
    assert group_tuning(old) == saved and group_tuning(saved) == saved


# ----------------------------------------------------------------------------- sections
def test_knobs_live_in_sections_under_their_flat_names():
    """The sections group the knobs by component; the flat name reaches them from every input."""
    assert set(KNOB_SECTION) == set(tuning_docs()) and len(KNOB_SECTION) == sum(
        len(dataclasses.fields(cls)) for cls in SECTIONS.values())          # a name is in one section only
    rt = RuntimeConfig(chunk_mb=64, schedule="eager")
    assert (rt.transfer.chunk_mb, rt.clip.schedule) == (64, "eager")
    moved = dataclasses.replace(rt, cache_units=0)
    assert (moved.placement.cache_units, moved.transfer.chunk_mb, rt.placement.cache_units) == (0, 64, -1)
    assert RuntimeConfig(**rt.to_flat()) == rt
    assert RuntimeConfig(clip=ClipScheduleTuning(schedule="deferred"), held_buffers=2).clip == ClipScheduleTuning(
        schedule="deferred", held_buffers=2)


def test_one_validator_gives_argparse_its_choices():
    with pytest.raises(ValueError, match="schedule must be auto, eager or deferred, not 'soon'"):
        RuntimeConfig(schedule="soon")
    with pytest.raises(ValueError, match="held_buffers must be -1, 1 or 2"):
        RuntimeConfig(held_buffers=3)
    with pytest.raises(ValueError, match="mode must be gpu, ckpt or slide"):
        RuntimeConfig(mode="tpu")
    code, _, err = run_main("train", "--tuning.schedule", "soon")
    assert code == 2 and "invalid choice: 'soon'" in err and "'deferred'" in err
    code, _, err = run_main("train", "--mode", "tpu")
    assert code == 2 and "invalid choice: 'tpu'" in err
    assert parse("--compile-layers", "true").runtime.compile_layers == "on"     # normalized fields: no choices
