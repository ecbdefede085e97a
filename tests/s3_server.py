"""A real S3 server on 127.0.0.1 for the tests: moto's ``moto_server`` in a process of its own,
reached through the client path users take (s3fs / botocore reading ``AWS_ENDPOINT_URL`` and
the credential variables), never a mock of our code.

``S3Server.start()`` picks a free port, starts ``moto_server -p PORT``, waits until it answers
and returns; ``stop()`` ends that process (by its own pid). The ``s3`` fixture in conftest.py
starts one per session and gives each test a fresh bucket and the environment pointing at it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REGION = 'us-east-1'
#: requests the server serves before it checks credentials: the three that make each of the
#: tests' two users (``_make_user``); from then on a wrong key is refused, as on AWS
_UNAUTHENTICATED = 6
_ALLOW_S3 = json.dumps(
    {'Version': '2012-10-17', 'Statement': [{'Effect': 'Allow', 'Action': 's3:*', 'Resource': '*'}]}
)
#: the second user's: it may read and list, not write or delete (a permission denied on save)
_READ_ONLY = json.dumps(
    {
        'Version': '2012-10-17',
        'Statement': [
            {'Effect': 'Allow', 'Action': ['s3:Get*', 's3:List*', 's3:Head*'], 'Resource': '*'}
        ],
    }
)


def moto_server_command() -> str | None:
    """``moto_server`` beside this interpreter (the venv's), else on PATH; None if absent."""
    beside = Path(sys.executable).with_name('moto_server')
    if beside.is_file():
        return str(beside)
    return shutil.which('moto_server')


def _die_with_parent() -> None:
    """In the server's process before exec (Linux): SIGTERM when the test process dies, so a
    killed test run leaves no server behind."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6', use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return int(sock.getsockname()[1])


class S3Server:
    """One ``moto_server`` process; ``endpoint`` is its URL once started."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.endpoint = ''
        self.start_seconds = 0.0
        self.credentials: dict[str, str] = {}
        self.read_only: dict[str, str] = {}  # backend_args of a user that may only read
        self.log: Any = None

    def start(self, timeout: float = 60.0) -> S3Server:
        command = moto_server_command()
        if command is None:
            raise RuntimeError('moto_server not found: pip install "moto[server]"')
        t0 = time.perf_counter()
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - kept open while the server runs
        for _ in range(3):  # another process may take the free port before moto binds it
            port = _free_port()
            self.endpoint = f'http://127.0.0.1:{port}'
            self.process = subprocess.Popen(
                [command, '-H', '127.0.0.1', '-p', str(port)],
                # a log file, never a pipe nobody reads: the server logs every request, and a
                # full pipe would stop it mid-request
                stdout=subprocess.DEVNULL,
                stderr=self.log,
                preexec_fn=_die_with_parent if sys.platform == 'linux' else None,
                env={**os.environ, 'INITIAL_NO_AUTH_ACTION_COUNT': str(_UNAUTHENTICATED)},
            )
            if self._wait_ready(t0 + timeout):
                self.credentials = self._make_user('stratagem-tests', _ALLOW_S3)
                read_only = self._make_user('stratagem-reader', _READ_ONLY)
                self.read_only = {
                    'key': read_only['AWS_ACCESS_KEY_ID'],
                    'secret': read_only['AWS_SECRET_ACCESS_KEY'],
                }
                self.start_seconds = time.perf_counter() - t0
                return self
            self.stop()
        self.log.seek(0)
        tail = self.log.read()[-2000:].decode(errors='replace')
        raise RuntimeError(f'moto_server did not answer on 127.0.0.1 within {timeout} s:\n{tail}')

    def _wait_ready(self, deadline: float) -> bool:
        assert self.process is not None
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.endpoint + '/moto-api/', timeout=1):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def _make_user(self, name: str, policy: str) -> dict[str, str]:
        """An IAM user with ``policy``, and its key pair (the server's only valid ones)."""
        import boto3

        iam = boto3.client(
            'iam',
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id='bootstrap',
            aws_secret_access_key='bootstrap',
        )
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName='s3', PolicyDocument=policy)
        key = iam.create_access_key(UserName=name)['AccessKey']
        return {
            'AWS_ACCESS_KEY_ID': key['AccessKeyId'],
            'AWS_SECRET_ACCESS_KEY': key['SecretAccessKey'],
        }

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def environment(self) -> dict[str, str]:
        """The variables a client needs to reach this server (botocore reads them)."""
        return {'AWS_ENDPOINT_URL': self.endpoint, 'AWS_DEFAULT_REGION': REGION, **self.credentials}
