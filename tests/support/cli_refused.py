"""The in-process check that the CLI refuses a command line: exit 2, one stderr line naming the field,
no traceback (the standard for bad input at the CLI)."""

from hebrus_mlx.cli import main as cli_main


def refused(capsys, argv, field):
    """Run `hebrus-mlx ARGV` here; assert it was refused naming `field`; return the stderr line."""
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"error: {field}: " in err, err
    return err
