"""Every command of deploy/README.md is run by a test as written, or excused with its reason."""

from __future__ import annotations

from tests.deploy.deploy_readme import NOT_RUN, ROOT, RUN_BY, commands


def test_every_command_is_run_or_excused() -> None:
    lines = commands()
    assert lines
    for line in lines:
        if line in NOT_RUN:
            continue
        owners = [(prefix, test) for prefix, test in RUN_BY.items() if line.startswith(prefix)]
        assert len(owners) == 1, f"deploy/README.md: no test runs {line!r}, and NOT_RUN does not excuse it"
        prefix, test = owners[0]
        assert prefix in (ROOT / test).read_text(), f"{test} does not run the command {line!r}"


def test_no_stale_entries() -> None:
    lines = commands()
    assert [line for line in NOT_RUN if line not in lines] == []
    assert [prefix for prefix in RUN_BY if not any(line.startswith(prefix) for line in lines)] == []
