"""`nodeforge render` and `validate` take the --variant that `build` takes: same choices, same
default, same refusal of a variant the target does not build (issue 26, item 6)."""

from __future__ import annotations

import argparse

import pytest

from nodeforge.cli import build_parser, main

pytestmark = pytest.mark.unit


def _variant_action(command: str) -> argparse.Action:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in sub.choices[command]._actions if "--variant" in a.option_strings)


def test_render_and_validate_take_builds_variant_option():
    build = _variant_action("build")
    for command in ("render", "validate"):
        got = _variant_action(command)
        assert (got.choices, got.default) == (build.choices, build.default), command


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_render_names_the_variant_it_renders_for(variant, capsys):
    assert main(["render", "--target", "local", "--variant", variant]) == 0
    out = capsys.readouterr().out
    assert f"target 'local', variant '{variant}'" in out
    assert 'source "null" "sandbox"' in out


@pytest.mark.parametrize("command", ["render", "validate", "build"])
@pytest.mark.parametrize("target", ["qemu", "amazon-ebs"])
def test_a_variant_the_target_does_not_build_is_refused_alike(command, target, capsys):
    assert main([command, "--target", target, "--variant", "gpu"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--variant gpu is built by the local target only (for now); use --target local, or --variant cpu for {target}"
        in err
    )


@pytest.mark.parametrize("bad", ["tpu", "GPU", "gpu\n", ""])
def test_render_refuses_an_unknown_variant_as_build_does(bad, capsys):
    for command in ("render", "build"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--variant", bad])
        assert exc.value.code == 2
        assert "argument --variant: invalid choice" in capsys.readouterr().err


def test_validate_gpu_without_target_validates_the_local_template(capsys):
    assert main(["validate", "--variant", "gpu", "--json"]) == 0
    import json

    assert set(json.loads(capsys.readouterr().out)) == {"local"}
