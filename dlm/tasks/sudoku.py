"""Sudoku: a generator of puzzles with exactly one solution, the rules, and the task's metrics.

`generate(n, clues, seed)` fills a random grid (randomised backtracking), then blanks cells in a
random order while the puzzle keeps exactly one solution, until it has the number of clues drawn
for it (uniformly from the range). A blanked cell whose digit is forced by its row, column and box
(a naked single) keeps the solution unique at no cost; any other is checked by counting solutions
(up to 2) with a bitmask solver. That greedy pass stops at a minimal puzzle, seldom below 24 clues; a
puzzle drawn with fewer (22-23 of the hard band, 17-21 of the extreme band) comes from a local search instead
(`make_sparse`): from a minimal puzzle, give back two of the solution's cells and blank greedily again,
keeping the result when it has no more clues, until it reaches the drawn count (a few seconds each; 20-21
clues are reached, 17-19 seldom: such a puzzle then has the fewest clues the search found within the
band). Puzzles come out in the public CSV layout (`quizzes,solutions`, 81 digits, 0 = blank;
dlm.data.csvtask), so public sets drop in and training reads them as documents.

Metrics of `dlm eval --task sudoku` (per puzzle, averaged): `accuracy` (the whole grid equals the
solution), `cell_accuracy` (the blanks filled correctly, over all blanks), `valid` (the output is a
complete grid that keeps the givens and obeys the rules; a puzzle has one solution, so valid and
correct differ only when the output is not a grid at all or breaks a rule).
"""

from __future__ import annotations

import random
from pathlib import Path

from dlm.errors import DlmError

ALL = 0x3FE  # bits 1..9
ROW = [i // 9 for i in range(81)]
COL = [i % 9 for i in range(81)]
BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
PEERS = [sorted({j for j in range(81) if j != i and (ROW[j] == ROW[i] or COL[j] == COL[i] or BOX[j] == BOX[i])})
         for i in range(81)]
DIGIT = {1 << d: d for d in range(1, 10)}


def _masks(grid: list[int]) -> tuple[list[int], list[int], list[int]]:
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, v in enumerate(grid):
        if v:
            b = 1 << v
            rows[ROW[i]] |= b
            cols[COL[i]] |= b
            boxes[BOX[i]] |= b
    return rows, cols, boxes


def count_solutions(grid: list[int], limit: int = 2) -> int:
    """Solutions of a grid (0 = blank), counted up to `limit`: backtracking on the cell with fewest candidates."""
    g = list(grid)
    rows, cols, boxes = _masks(g)
    if sum(bin(m).count("1") for m in rows) != sum(1 for v in g if v):
        return 0  # a digit repeated in a row (columns and boxes are checked by the search below)
    empties = [i for i, v in enumerate(g) if not v]
    found = 0

    def search(k: int) -> None:
        nonlocal found
        if k == len(empties):
            found += 1
            return
        best, best_cand, best_n = k, 0, 10
        for j in range(k, len(empties)):  # the most constrained blank goes next
            i = empties[j]
            cand = ALL & ~(rows[ROW[i]] | cols[COL[i]] | boxes[BOX[i]])
            n = bin(cand).count("1")
            if n < best_n:
                best, best_cand, best_n = j, cand, n
                if n <= 1:
                    break
        if best_n == 0:
            return
        empties[k], empties[best] = empties[best], empties[k]
        i = empties[k]
        r, c, b = ROW[i], COL[i], BOX[i]
        cand = best_cand
        while cand and found < limit:
            bit = cand & -cand
            cand ^= bit
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            search(k + 1)
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
        empties[k], empties[best] = empties[best], empties[k]

    if _consistent(g):
        search(0)
    return found


def _consistent(grid: list[int]) -> bool:
    """No digit twice in a row, column or box."""
    seen: set[tuple[str, int, int]] = set()
    for i, v in enumerate(grid):
        if v:
            for key in (("r", ROW[i], v), ("c", COL[i], v), ("b", BOX[i], v)):
                if key in seen:
                    return False
                seen.add(key)
    return True


def random_grid(rng: random.Random) -> list[int]:
    """A complete valid grid: randomised backtracking, cell by cell, digits in random order."""
    g = [0] * 81
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9

    def fill(i: int) -> bool:
        if i == 81:
            return True
        r, c, b = ROW[i], COL[i], BOX[i]
        free = ALL & ~(rows[r] | cols[c] | boxes[b])
        digits = [d for d in range(1, 10) if free >> d & 1]
        rng.shuffle(digits)
        for d in digits:
            bit = 1 << d
            g[i] = d
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            if fill(i + 1):
                return True
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
        g[i] = 0
        return False

    fill(0)
    return g


def forced(grid: list[int], i: int) -> bool:
    """Is blank cell i a naked single (exactly one digit left by its row, column and box)?"""
    used = 0
    for j in PEERS[i]:
        if grid[j]:
            used |= 1 << grid[j]
    return bin(ALL & ~used).count("1") == 1


def make_puzzle(rng: random.Random, clues: int, tries: int = 50) -> tuple[str, str]:
    """(quiz, solution) as 81-digit strings, the quiz with exactly `clues` givens and one solution."""
    for _ in range(tries):
        solution = random_grid(rng)
        g = list(solution)
        order = list(range(81))
        rng.shuffle(order)
        left = 81
        for i in order:
            if left == clues:
                break
            v, g[i] = g[i], 0
            if forced(g, i) or count_solutions(g, 2) == 1:
                left -= 1
            else:
                g[i] = v
        if left == clues:
            return "".join(map(str, g)), "".join(map(str, solution))
    raise DlmError(f"--clues: could not make a puzzle with a unique solution and {clues} clues in {tries} tries")


SPARSE = 24  # fewer clues than this: make_sparse (the greedy pass of make_puzzle seldom gets there)


def _minimise(rng: random.Random, g: list[int]) -> list[int]:
    """Blank the givens of g in a random order while the puzzle keeps exactly one solution (a minimal puzzle)."""
    order = [i for i in range(81) if g[i]]
    rng.shuffle(order)
    for i in order:
        v, g[i] = g[i], 0
        if not (forced(g, i) or count_solutions(g, 2) == 1):
            g[i] = v
    return g


def make_sparse(rng: random.Random, clues: int, band: tuple[int, int], tries: int = 20, rounds: int = 300,
                patience: int = 40) -> tuple[str, str]:
    """(quiz, solution) with `clues` givens if the search finds them within `rounds` (stopping after `patience`
    rounds without fewer clues), else the fewest it found within the band (low, high); one solution. Local search
    over minimal puzzles of one grid, then a new grid."""
    least, most = band
    for _ in range(tries):
        solution = random_grid(rng)
        best = _minimise(rng, list(solution))
        n_best = sum(1 for v in best if v)
        since = 0
        for _ in range(rounds):
            if n_best <= clues or since >= patience:
                break
            since += 1
            g = list(best)
            for i in rng.sample([i for i in range(81) if not g[i]], 2):  # give two cells back, blank again
                g[i] = solution[i]
            g = _minimise(rng, g)
            n = sum(1 for v in g if v)
            if least <= n <= n_best:
                since = 0 if n < n_best else since
                best, n_best = g, n
        if least <= n_best <= most:
            return "".join(map(str, best)), "".join(map(str, solution))
    raise DlmError(f"--clues: could not make a puzzle with a unique solution and {least}-{most} clues in {tries} "
                   "grids")


def parse_clues(spec: str) -> tuple[int, int]:
    """'40-50' or '45' -> (low, high)."""
    try:
        lo, _, hi = spec.partition("-")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise DlmError(f"--clues must be A-B or A (givens per puzzle), got {spec!r}") from None
    if not 17 <= a <= b <= 80:
        raise DlmError(f"--clues must satisfy 17 <= A <= B <= 80 (a unique sudoku has >= 17 clues), got {spec!r}")
    return a, b


def generate(n: int, clues: tuple[int, int], seed: int = 0) -> list[tuple[str, str]]:
    """n puzzles, reproducible for (n, clues, seed); puzzle k depends on (seed, k) only. A drawn count below
    SPARSE clues goes to make_sparse (at most that many clues, within the band)."""
    if n <= 0:
        raise DlmError(f"--n must be > 0, got {n}")
    out = []
    for k in range(n):
        rng = random.Random(f"sudoku:{seed}:{k}")
        target = rng.randint(*clues)
        out.append(make_puzzle(rng, target) if target >= SPARSE else make_sparse(rng, target, clues))
    return out


def symmetry(rng: random.Random) -> tuple[list[int], list[int]]:
    """A random validity-preserving transform of the grid: (cell map, digit map). Cell i of the new grid is cell
    map[i] of the old one, digit d becomes digits[d]: a relabelling of the digits, the bands and the stacks
    permuted, the rows within each band and the columns within each stack permuted, and a transpose or not.
    Clue count and uniqueness of the solution are kept."""
    def lines() -> list[int]:
        bands = rng.sample(range(3), 3)
        return [3 * b + r for b in bands for r in rng.sample(range(3), 3)]
    rows, cols, flip = lines(), lines(), rng.random() < 0.5
    cells = [(cols[c] * 9 + rows[r]) if flip else (rows[r] * 9 + cols[c]) for r in range(9) for c in range(9)]
    digits = [0] + rng.sample(range(1, 10), 9)
    return cells, digits


def augment(pairs: list[tuple[str, str]], k: int, seed: int) -> list[tuple[str, str]]:
    """Each puzzle and k - 1 random symmetric copies of it (`symmetry`), shuffled; reproducible for the seed."""
    if k < 1:
        raise DlmError(f"--augment must be >= 1, got {k}")
    rng = random.Random(f"sudoku-augment:{seed}")
    out = []
    for quiz, sol in pairs:
        out.append((quiz, sol))
        for _ in range(k - 1):
            cells, digits = symmetry(rng)
            out.append(("".join(str(digits[int(quiz[i])]) for i in cells),
                        "".join(str(digits[int(sol[i])]) for i in cells)))
    rng.shuffle(out)
    return out


def clues_of(quiz: str) -> int:
    return sum(1 for c in quiz if c != "0")


# the rules and the metrics -----------------------------------------------------------------------

def parse_grid(text: str) -> list[int] | None:
    """The first 81 characters of a model's output as digits, or None when they are not 81 digits 1-9."""
    cells = text.strip()[:81]
    if len(cells) != 81 or not all(c in "123456789" for c in cells):
        return None
    return [int(c) for c in cells]


def is_valid(quiz: str, grid: list[int] | None) -> bool:
    """A complete grid that keeps every given digit and has no digit twice in a row, column or box."""
    if grid is None or len(grid) != 81 or not all(1 <= v <= 9 for v in grid):
        return False
    if any(q != "0" and int(q) != v for q, v in zip(quiz, grid)):
        return False
    return _consistent(grid)


def grade(quiz: str, solution: str, output: str) -> dict[str, float]:
    """accuracy (whole grid), cell_accuracy (over the quiz's blanks), valid: of one model output."""
    grid = parse_grid(output)
    text = output.strip()
    blanks = [i for i, q in enumerate(quiz) if q == "0"]
    right = sum(1 for i in blanks if i < len(text) and text[i] == solution[i])
    return {"accuracy": float(grid is not None and "".join(map(str, grid)) == solution),
            "cell_accuracy": right / len(blanks) if blanks else 1.0,
            "valid": float(is_valid(quiz, grid)),
            "blanks": len(blanks)}


# the task: `dlm eval --task sudoku` ---------------------------------------------------------------

NAME = "sudoku"
METRICS = ("accuracy", "cell_accuracy", "valid")
PRIMARY = "accuracy"  # the quality axis of `dlm bench --task`
HELDOUT_SEED = 1_000_000  # without --data: fresh puzzles from seed HELDOUT_SEED + --seed (the recipes train on seed 0)
HELDOUT_CLUES = (40, 50)


def default_new_tokens(span: str) -> int:
    return 81


def cases(data: str | None, n: int, seed: int, span: str = "line", split: str = "test",
          clues: str | None = None) -> list:
    """Puzzles of a CSV in the public layout (n of them, picked by seed; with `clues` 'A-B', only those with A to B
    givens), else n fresh puzzles of `clues` givens (default 40-50; held out by construction: `split` does not
    apply)."""
    from dlm.data.csvtask import read_pairs
    from dlm.tasks.common import Case, check_n, pick, rng_for

    check_n(n)
    band = parse_clues(clues) if clues is not None else None
    if data is None:
        pairs = generate(n, band or HELDOUT_CLUES, HELDOUT_SEED + seed)
        return [Case(f"generated:{HELDOUT_SEED + seed}:{k}", q, s) for k, (q, s) in enumerate(pairs)]
    pairs = read_pairs(data)
    keep = [r for r, (q, _) in enumerate(pairs) if band is None or band[0] <= clues_of(q) <= band[1]]
    if not keep:
        raise DlmError(f"--data {data}: no puzzle has {clues} clues")
    rows = pick(rng_for(NAME, seed), keep, n)
    return [Case(f"{Path(data).name}:{r + 2}", *pairs[r]) for r in rows]


def request(case, ck, cfg, style: str, context: int):
    """AR: continue QUIZ= for 81 tokens. Diffusion: infill the 81-cell solution canvas after QUIZ=, the given
    digits pinned (they are known), the blanks holes."""
    from dlm.data.csvtask import SEP
    from dlm.sampling.common import Prompt
    from dlm.tasks.common import Request

    tok = ck.tokenizer
    ids = tok.encode(case.prefix + SEP)
    if style == "ar":
        return Request(Prompt(ids), cfg.max_new_tokens, lambda res: res.text)
    digit = {c: tok.encode(c, specials=False)[-1] for c in "123456789"}
    canvas = [None if c == "0" else digit[c] for c in case.prefix]
    return Request(Prompt(ids, canvas), 81, lambda res: tok.decode(res.tokens[0][:81]))


def valid(case, answer: str) -> bool:
    """The rule checker of `--tries`: a complete grid that keeps the givens and obeys the rules (the solution is not
    read; a puzzle has one solution, so a valid grid is the solution)."""
    return is_valid(case.prefix, parse_grid(answer))


def score(case, answer: str) -> dict[str, float]:
    return grade(case.prefix, case.target, answer)
