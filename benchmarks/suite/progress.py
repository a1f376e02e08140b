"""Progress lines on stdout, time-stamped (a suite run takes up to 30 minutes)."""
import time


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)
