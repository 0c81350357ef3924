# Env propagation: prefixed variables and .zeroshard_env / .deepspeed_env lines (launcher/envfile.py).
import pytest

from zeroshard.launcher.envfile import EnvFileError, collect_exports, parse_env_text


def test_parse_env_text():
    text = "# comment\n\nA=1\nexport B = x=y # not a comment\n  C=\nD=with space\n"
    assert parse_env_text(text, "f") == {"A": "1", "B": " x=y # not a comment", "C": "", "D": "with space"}


@pytest.mark.parametrize("line", ["NOEQUALS", "1A=x", "A B=x", "=x"])
def test_malformed_line_names_file_and_line(line):
    with pytest.raises(EnvFileError, match=rf'^/h/.zeroshard_env line 2: "{line}": expected KEY=VALUE'):
        parse_env_text(f"OK=1\n{line}\n", "/h/.zeroshard_env")


def test_collect_exports(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME_DS=1\nSHARED=home-ds\n")
    (home / ".zeroshard_env").write_text("SHARED=home-zs\n")
    (cwd / ".zeroshard_env").write_text("# cwd wins\nSHARED=cwd\n")
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/lib", "UCX_TLS": "tcp", "GLOO_SOCKET_IFNAME": "eth1",
               "OMP_NUM_THREADS": "4", "HOME": "/x", "SECRET": "no", "CUDA_VISIBLE_DEVICES": "0"}
    got = collect_exports(environ, str(cwd), str(home))
    assert got == {"NCCL_DEBUG": "INFO", "PYTHONPATH": f"{cwd}:/lib", "UCX_TLS": "tcp",
                   "GLOO_SOCKET_IFNAME": "eth1", "OMP_NUM_THREADS": "4", "FROM_HOME_DS": "1",
                   "SHARED": "cwd"}


def test_pythonpath_is_cwd_when_unset(tmp_path):
    assert collect_exports({}, str(tmp_path), str(tmp_path)) == {"PYTHONPATH": str(tmp_path)}
