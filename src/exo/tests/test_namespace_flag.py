"""A namespace zenoh cannot use in a key is a one-line flag error (exit status 2), as every
other bad flag value is. A new-user trial (2026-12-07) found `exo --namespace 'a/b*c'`,
`--namespace ''` and `EXO_NAMESPACE='bad ns'` printing an 18-line traceback from
`zenoh_router.check_key_chunk` when the node started."""

import pytest

from exo.node_options import parse_args


@pytest.mark.parametrize("namespace", ["", "a/b*c", "bad ns"])
def test_a_namespace_zenoh_cannot_use_is_a_flag_error(
    namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--namespace", namespace])
    assert exit_info.value.code == 2
    assert "--namespace" in capsys.readouterr().err


def test_a_bad_exo_namespace_is_a_flag_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EXO_NAMESPACE", "bad ns")
    with pytest.raises(SystemExit) as exit_info:
        parse_args([])
    assert exit_info.value.code == 2
    assert "EXO_NAMESPACE" in capsys.readouterr().err


def test_a_namespace_of_key_characters_is_taken() -> None:
    assert parse_args(["--namespace", "lab-2.cluster_a"]).namespace == "lab-2.cluster_a"
