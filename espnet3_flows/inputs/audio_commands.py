"""Audio entries that are commands (``sph2pipe -f wav x.sph |``, Kaldi's ``wav.scp`` pipes): run
under a deadline with their children, and a WAV streamed to the pipe (sizes unknown) made readable."""

from __future__ import annotations

import os
import signal
import struct
import subprocess

from espnet3_flows.inputs.audio_config import AudioConfig, AudioError
from espnet3_flows.inputs.pcm_wav import riff_chunks


def run_pipe(command: str, config: AudioConfig, cwd: str = "") -> bytes:
    """The standard output of an audio command (``cmd |``), run by the shell in ``cwd``.

    Raises:
        AudioError: commands are not allowed, the command is not ``cmd |``, it failed, or it
            wrote nothing (its standard error is in the message).
        TimeoutError: it ran longer than ``config.pipe_timeout`` (it is killed with its children).
    """
    if not config.allow_pipes:
        raise AudioError("the audio entry is a command and allow_pipes is false")
    cmd = command.strip()
    if cmd.startswith("|") or not cmd.endswith("|"):
        raise AudioError(f"a command entry must be 'command |' (got {command!r})")
    cmd = cmd[:-1].strip()
    with subprocess.Popen(cmd, shell=True, cwd=cwd or None, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=config.pipe_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            raise TimeoutError(f"command {cmd!r} ran longer than pipe_timeout={config.pipe_timeout:g} s"
                               + _stderr_tail(err)) from None
    if proc.returncode != 0:
        raise AudioError(f"command {cmd!r} failed with exit status {proc.returncode}" + _stderr_tail(err))
    if not out:
        raise AudioError(f"command {cmd!r} wrote no audio" + _stderr_tail(err))
    return out


def _stderr_tail(err: bytes | None) -> str:
    text = (err or b"").decode("utf-8", "replace").strip()
    return f"; stderr: {text[-500:]}" if text else ""


def _streamed_wav_sizes(data: bytes) -> bytes:
    """A WAV written to a pipe cannot seek back to fill in its sizes (sox and sph2pipe leave 0 or
    0xFFFFFFFF): set the RIFF and data sizes from the bytes received; other data is unchanged."""
    for cid, pos, size in riff_chunks(data):
        if cid == b"data":
            real = len(data) - pos - 8
            if size in (0, 0xFFFFFFFF) or size > real:
                fixed = bytearray(data)
                fixed[pos + 4:pos + 8] = struct.pack("<I", real)
                fixed[4:8] = struct.pack("<I", len(data) - 8)
                return bytes(fixed)
            return data
    return data
