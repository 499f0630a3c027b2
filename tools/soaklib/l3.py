"""The daemon's L3 directory and the faults done to it: corrupt and delete object files, make
it read-only, fill its filesystem; its files and bytes on disk for the KV accounting."""

from __future__ import annotations

import atexit
import os
import random
import shutil
import subprocess
import time
from pathlib import Path


class L3Dir:
    """The daemon's L3 directory and the faults done to it. As root (CAP_SYS_ADMIN) it is a
    tmpfs of its own, so read-only is a remount and disk-full a filler file."""

    def __init__(self, root: Path, fs_mb: int = 0, mount: bool = True) -> None:
        self.path = root / "kv"
        self.path.mkdir(parents=True, exist_ok=True)
        self.mounted = False
        if mount and fs_mb and os.geteuid() == 0 and shutil.which("mount"):
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={fs_mb}m,mode=0700", "tmpfs", str(self.path)],
                capture_output=True,
                text=True,
                check=False,
            )
            self.mounted = r.returncode == 0
            if self.mounted:
                atexit.register(self.cleanup)
        self._filler = self.path / ".filler"  # not under a fan-out dir: not an object

    def unsupported(self, fault: str) -> str | None:
        """Why ``fault`` cannot be done honestly here (None: it can)."""
        if fault == "readonly" and not self.mounted and os.geteuid() == 0:
            return "root without mount rights: chmod does not stop root's writes"
        if fault == "diskfull" and not self.mounted:
            return "needs a size-limited filesystem (a tmpfs mount needs root / CAP_SYS_ADMIN)"
        return None

    def files(self) -> list[Path]:
        out = []
        try:
            for sub in os.scandir(self.path):
                if sub.is_dir():
                    out += [Path(e.path) for e in os.scandir(sub.path) if e.name.endswith(".kv")]
        except FileNotFoundError:
            pass
        return sorted(out)

    def usage(self) -> tuple[int, int]:
        """(object files, their bytes) on disk."""
        n = size = 0
        for p in self.files():
            try:
                size += p.stat().st_size
                n += 1
            except FileNotFoundError:
                pass
        return n, size

    def corrupt(self, rng: random.Random, n: int) -> int:
        """Flip 1-4 bytes in each of up to ``n`` random object files (header or payload)."""
        done = 0
        files = self.files()
        for p in rng.sample(files, min(n, len(files))):
            try:
                with open(p, "r+b") as f:
                    size = os.fstat(f.fileno()).st_size
                    for _ in range(rng.randint(1, 4)):
                        off = rng.randrange(size)
                        f.seek(off)
                        b = f.read(1)
                        f.seek(off)
                        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                done += 1
            except (FileNotFoundError, IndexError):
                pass
        return done

    def delete(self, rng: random.Random, n: int) -> int:
        """Remove up to ``n`` random object files; one time in three a whole fan-out dir."""
        files = self.files()
        if files and rng.random() < 1 / 3:
            victim = rng.choice(files).parent
            count = len(list(victim.glob("*.kv")))  # NOTE: 0 when the daemon emptied it first
            shutil.rmtree(victim, ignore_errors=True)
            return count
        done = 0
        for p in rng.sample(files, min(n, len(files))):
            try:
                p.unlink()
                done += 1
            except FileNotFoundError:
                pass
        return done

    def set_readonly(self, on: bool) -> None:
        if self.mounted:
            opt = "remount,ro" if on else "remount,rw"
            for _ in range(100):  # EBUSY while a file is open for writing
                r = subprocess.run(
                    ["mount", "-o", opt, str(self.path)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if r.returncode == 0:
                    return
                time.sleep(0.05)
            raise RuntimeError(f"mount -o {opt} failed: {r.stderr.strip()}")
        mode = 0o500 if on else 0o700
        for d in [self.path, *(p for p in self.path.iterdir() if p.is_dir())]:
            os.chmod(d, mode)

    def fill(self, on: bool) -> None:
        """Fill the filesystem to the last byte (a filler file), or free it again."""
        if not on:
            self._filler.unlink(missing_ok=True)
            return
        chunk = b"\0" * (1 << 20)
        with open(self._filler, "wb", buffering=0) as f:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        f.write(chunk[:size])
                except OSError:
                    continue

    def cleanup(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
            self.mounted = False
