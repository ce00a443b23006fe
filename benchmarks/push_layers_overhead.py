"""Per-call cost of push_layers over 32 layers against 32 separate pushes, in
warm memory (64 calls between clears, the clears timed and subtracted).

    python benchmarks/push_layers_overhead.py
"""
import time

import numpy as np

import ferrox_kv as fk


def main():
    for h, d in [(2, 64), (8, 128)]:
        cs = [fk.KvCache.with_capacity(h, d, 64) for _ in range(32)]
        k = np.ones((32, h * d), np.float32)
        k1 = np.ones(h * d, np.float32)

        def clear():
            for c in cs:
                c.clear()

        def best(f, n=20000):
            b = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(n // 64):
                    clear()
                    for _ in range(64):
                        f()
                b = min(b, (time.perf_counter() - t) / (n // 64 * 64))
            return b

        def each():
            for c in cs:
                c.push(k1, k1)

        t_clear = best(lambda: None)
        pl = best(lambda: fk.push_layers(cs, k, k)) - t_clear
        ea = best(each) - t_clear
        print(f"{h}x{d}: push_layers {pl * 1e6:.2f} us, 32 pushes {ea * 1e6:.2f} us, "
              f"ratio {pl / ea:.2f}")


if __name__ == "__main__":
    main()
