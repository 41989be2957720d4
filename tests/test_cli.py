# The `shardwise` command.
import subprocess
import sys

import shardwise as sw
from shardwise.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert capsys.readouterr().out.strip() == f"shardwise {sw.__version__}"
    assert sw.__version__ == "0.1.0"


def test_env_subcommand_prints_detected_fields():
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "env"], capture_output=True,
                         text=True, check=True, env={"PATH": "", "RANK": "1", "WORLD_SIZE": "2",
                                                     "LOCAL_RANK": "1"}).stdout
    assert "world_size           2" in out and "launcher             env" in out
