"""`axon tenants`: a bad weight or tenant is refused before anything is opened (exit 2, stderr)."""

import pytest

from services.cli.main import main


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["acme", "--weight", "0"], "weight"),
        (["acme", "--weight=-1"], "weight"),
        (["acme", "--weight", "abc"], "'abc' is not a number"),
        (["acme", "--weight", "nan"], "finite"),
        (["acme", "--weight", "1e7"], "weight"),
        (["x" * 129, "--weight", "2"], "tenant"),
    ],
)
def test_a_bad_weight_or_tenant_exits_2_with_the_reason_on_stderr(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nowhere to connect to: a refusal must come before any connection.
    monkeypatch.setenv("AXON_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("AXON_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(["tenants", "set", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("axon: ") and said in err


def test_set_needs_a_weight(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["tenants", "set", "acme"])
    assert exited.value.code == 2 and "--weight" in capsys.readouterr().err
