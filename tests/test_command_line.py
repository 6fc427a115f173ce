"""kvmesh.command_line: the one place an error that stops a command becomes one line and an exit status."""

from __future__ import annotations

import errno

import pytest
import redis.exceptions

from kvmesh import errors
from kvmesh.command_line import BAD_INPUT, INTERRUPTED, RUNTIME, Parser, UsageError, report, run_command


@pytest.mark.parametrize("exc, status, words", [
    (UsageError("argument --x: bad"), BAD_INPUT, ["argument --x: bad", "`kvmesh t --help`"]),
    (errors.InvalidArgument("limit < 0; give a limit >= 0"), BAD_INPUT, ["give a limit"]),
    (errors.Unavailable("redis server exited at start: x; see its log"), RUNTIME, ["exited at start"]),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/k"), BAD_INPUT, ["cannot use /k", "check"]),
    (OSError(errno.EADDRINUSE, "Address already in use"), RUNTIME, ["cannot listen", "pick another port"]),
    (redis.exceptions.ConnectionError("Error 111"), RUNTIME, ["Redis unreachable", "start Redis"]),
    (redis.exceptions.AuthenticationError("WRONGPASS"), RUNTIME, ["refused the credentials"]),
    (redis.exceptions.NoPermissionError("NOPERM set"), RUNTIME, ["denied a command"]),
    (ExceptionGroup("one", [errors.NotFound("no tenant t; list them")]), RUNTIME, ["no tenant t"]),
    (KeyboardInterrupt(), INTERRUPTED, ["interrupted"]),
    (TypeError("a bug\nover lines"), RUNTIME, ["internal error (TypeError: a bug over lines)", "KVMESH_TRACEBACK"]),
])
def test_each_kind_of_error_is_one_line_with_its_status(exc, status, words, capsys):
    assert report("kvmesh t", exc) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvmesh t: error: "), err
    for word in words:
        assert word in err, (word, err)


def test_run_command_keeps_a_status_and_reports_what_stopped_main(capsys):
    assert run_command("kvmesh t", lambda argv: len(argv), ["a", "b"]) == 2
    assert run_command("kvmesh t", lambda argv: None, []) == 0

    def exits(argv):
        raise SystemExit(3)

    assert run_command("kvmesh t", exits, []) == 3

    def fails(argv):
        raise errors.PermissionDenied("needs root; run it as root")

    assert run_command("kvmesh t", fails, []) == RUNTIME
    assert capsys.readouterr().err == "kvmesh t: error: needs root; run it as root\n"


def test_a_subcommands_bad_input_points_to_that_subcommands_help(capsys):
    """``kvmesh admin tenants create`` without its tenant id: the line points to ``kvmesh admin tenants create
    --help`` (which lists what it takes), not ``kvmesh admin --help`` (which lists only the subcommands)."""
    parser = Parser(prog="kvmesh admin")
    create = parser.add_subparsers(dest="area", required=True).add_parser("tenants").add_subparsers(
        dest="action", required=True).add_parser("create")
    create.add_argument("tenant_id")
    assert run_command("kvmesh admin", parser.parse_args, ["tenants", "create"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("kvmesh admin: error: the following arguments are required: tenant_id; ")
    assert "`kvmesh admin tenants create --help` lists" in err and err.count("\n") == 1
    assert run_command("kvmesh admin", parser.parse_args, ["nope"]) == BAD_INPUT  # control: the top level's own
    assert "`kvmesh admin --help` lists" in capsys.readouterr().err
