"""Command line: ``python -m conformance`` or ``kfac-conformance`` (see README.md).

``main(argv, prog)`` is the whole program; ``prog`` is how the user invoked it, so that help
and hints show the command they typed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

#: where reports go unless --out says otherwise: relative, so under the current directory
#: (an installed package's folder may be read-only, and reports are the user's files)
DEFAULT_OUT = Path("conformance-reports")
COMMANDS = ("run", "golden", "list", "matrix", "docs", "new-adapter")
PROG = "python -m conformance"
SCRIPT = "kfac-conformance"
_PKG = Path(__file__).resolve().parent

EXIT_STATUS = """\
exit status:
  0  every selected case passed (or passed under a declared convention) and at least one
     was compared; golden --check: the golden files are intact and up to date
  1  a case failed or errored, or nothing was compared (an empty run never passes);
     with --all-adapters: an installed, non-mutant adapter failed; golden --check: a
     golden file is missing, corrupt or out of date
  2  usage error: an unknown option, an adapter that cannot be loaded or is unavailable
     here (not installed), golden files that cannot be read
130  interrupted (Ctrl-C): the reports of the cases run so far are written, marked
     interrupted"""


#: exit status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it)
EXIT_INTERRUPTED = 130
#: default of ``run --case-timeout`` (conformance.runner.DEFAULT_CASE_TIMEOUT; repeated here so
#: that ``--help`` does not import the runner)
DEFAULT_CASE_TIMEOUT = 60.0

#: widest line ``list`` prints (a terminal of 100 columns)
LIST_WIDTH = 100


def _same_python(candidate: str) -> bool:
    """Whether the interpreter ``candidate`` (a path) runs in this environment."""
    if os.path.abspath(candidate) == os.path.abspath(sys.executable):
        return True
    try:
        out = subprocess.run([candidate, "-c", "import sys; print(sys.prefix)"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.strip() == sys.prefix


def command(prog: str = PROG) -> str:
    """The command that runs the suite again from the current directory, for hints.

    ``python -m conformance`` when ``python`` on the PATH is this environment's interpreter
    (an activated virtual environment), else this interpreter's path (relative to the
    current directory when that is shorter): ``.venv/bin/python -m conformance`` run from a
    shell that has not activated ``.venv``.  The console script likewise: its name when the
    PATH finds it, else the path it was run by."""
    if prog == PROG:
        for name in ("python", "python3"):
            found = shutil.which(name)
            if found and _same_python(found):
                return f"{name} -m conformance"
        return f"{shlex.quote(_short_path(sys.executable))} -m conformance"
    if prog == SCRIPT:
        argv0 = sys.argv[0] if sys.argv else ""
        found = shutil.which(SCRIPT)
        if Path(argv0).name == SCRIPT and not (
                found and os.path.abspath(found) == os.path.abspath(argv0)):
            return shlex.quote(_short_path(argv0))
    return prog


def _short_path(path: str) -> str:
    """``path`` relative to the current directory when it lies below it, else absolute."""
    full = os.path.abspath(path)
    try:
        rel = os.path.relpath(full)
    except ValueError:  # another drive (Windows)
        return full
    return rel if not rel.startswith("..") else full


def version() -> str:
    """The project's one version (kfac_ref and its suite are released together)."""
    try:
        import kfac_ref

        return kfac_ref.__version__
    except ImportError:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as _dist_version

        try:
            return _dist_version("kfac_ref")
        except PackageNotFoundError:
            return "unknown"


def _conventions_text(adapter) -> str:
    """An adapter's declared conventions: ``canonical`` or ``field=value, ...``."""
    diff = adapter.conventions.differences()
    return ", ".join(f"{k}={v!r}" for k, v in diff.items()) or "canonical"


def _adapter_lines(conventions: bool = False, width: int | None = None) -> list[str]:
    """One line per shipped and external (entry-point) adapter: name and description; with
    ``conventions``, a second line with its declared conventions (wrapped).  With ``width``,
    descriptions are cut to fit that many columns (the entry-point note is kept)."""
    from .adapter import load_adapter
    from .adapters import ENTRY_POINT_GROUP, broken, distribution_of, external, shipped

    rows = []
    ext = external()
    for name in [*shipped(), *ext]:
        conv = ""
        try:
            adapter = load_adapter(name)
            desc = adapter.description
            conv = _conventions_text(adapter)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken adapter is listed as such
            desc = f"(cannot be loaded: {type(exc).__name__}: {exc})"
        note = ""
        if name in ext:
            dist = distribution_of(name)
            note = f" [entry point {ENTRY_POINT_GROUP}" + (f" of {dist}]" if dist else "]")
        rows.append((name, desc, conv, note))
    for mod, why in broken().items():  # its adapters' names are unknown: the module's;
        # the error is the note, never cut
        rows.append((mod.rsplit(".", 1)[1], "", "", f"(module {mod} cannot be imported: {why})"))
    w = max(len(n) for n, *_ in rows)
    out = []
    for n, d, c, note in rows:
        line = f"  {n:<{w}}  {d}"
        if width and not note:  # an entry point's note names its distribution: kept whole
            line = _fit(line, width)
        out.append(line + note)
        if conventions and c:
            out.append(textwrap.fill(f"conventions: {c}", width=width or 10**6,
                                     initial_indent=" " * (w + 6),
                                     subsequent_indent=" " * (w + 8), break_on_hyphens=False))
    return out


def _epilog(prog: str) -> str:
    from .adapter import ENV_VAR

    wrap = "\n".join
    return wrap([
        f"adapters (--adapter NAME, or {ENV_VAR}=NAME; default kfac_ref):",
        *_adapter_lines(),
        "  or a module (mypkg.my_adapter[:attr]) or a file (./my_adapter.py): how to write",
        f"  one is in conformance/README.md, `{prog} new-adapter NAME` writes a skeleton,",
        "  and installed packages add theirs through the entry-point group",
        "  kfac_ref.conformance_adapters.  Peers run in their own environments",
        "  (conformance/peers/README.md); `list` also shows the deliberately wrong mutant_*",
        "  adapters that test the diagnosis.",
        "",
        "environment:",
        f"  {ENV_VAR}  the adapter to run when --adapter is not given",
        "",
        "reports: report.json, junit.xml, report.md and report.html (one self-contained page)",
        f"  in {DEFAULT_OUT}/<adapter>/ under the current directory (--out DIR to change).",
        "",
        "The default run is a self-check: kfac_ref against its own golden vectors.  To check",
        "another implementation:",
        f"  {prog} list              shows the adapters",
        f"  {prog} --adapter NAME    runs one (a name above, a module or a file.py)",
        "",
        EXIT_STATUS,
    ])


def _run_options_text(run_parser, prog: str) -> str:
    """The options of ``run`` formatted as in ``run --help``, for the top-level help (``run``
    is the default command, so they are the options most runs need)."""
    fmt = argparse.HelpFormatter(prog)
    fmt.start_section("run options (run is the default command; `run --help` says the same)")
    fmt.add_arguments([a for a in run_parser._actions if a.dest != "help"])
    fmt.end_section()
    return fmt.format_help().strip("\n")


def _seconds(text: str) -> float:
    """A ``--case-timeout`` value: a number of seconds ≥ 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit); "
                                         f"got {text!r}")
    return value


def _parser(prog: str = PROG):
    epilog = _epilog(prog)
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=fmt, epilog=epilog,
        usage=f"{prog} [run] [options]  |  {prog} {{golden,list,matrix,docs,new-adapter}} ...",
        description=textwrap.fill(
            "Check a K-FAC implementation against the kfac_ref reference, case by case, and "
            "name the pitfall behind every disagreement.  Without a command it runs `run`.",
            width=88) + f"\n`{prog} COMMAND --help` describes a command.")
    p.add_argument("--version", action="version", version=f"{prog} {version()}")
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND", prog=prog)

    r = sub.add_parser("run", help="run the suite against one adapter (the default command)",
                       formatter_class=fmt, epilog=epilog,
                       description="Run the conformance cases against one adapter and write "
                                   "reports.")
    r.add_argument("--adapter", "-a", default=None, metavar="NAME",
                   help="adapter name, module[:attr] or file.py (default: "
                        "$KFAC_CONFORMANCE_ADAPTER, else kfac_ref)")
    r.add_argument("--all-adapters", action="store_true",
                   help="run every shipped and installed (entry-point) adapter and write "
                        "the ecosystem matrix")
    r.add_argument("--with-mutants", action="store_true",
                   help="with --all-adapters: include the deliberately wrong adapters")
    r.add_argument("--source", choices=("auto", "live", "golden"), default="auto",
                   help="expected values: 'golden' = the committed golden vectors only "
                        "(sha256-checked), 'live' = computed now by kfac_ref, 'auto' = golden "
                        "plus live cases the golden files lack (default)")
    r.add_argument("--family", action="append", help="restrict to a family (repeatable)")
    r.add_argument("--capability", "-c", action="append",
                   help="restrict to capabilities (fnmatch pattern, repeatable)")
    r.add_argument("-k", dest="keyword", help="restrict to case ids containing this string")
    r.add_argument("--skips", help="file of case-id/capability patterns to skip")
    r.add_argument("--xfails", help="file of case-id/capability patterns expected to fail")
    r.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                   help=f"report directory (default: ./{DEFAULT_OUT}, under the current "
                        "directory)")
    r.add_argument("--case-timeout", type=_seconds, default=DEFAULT_CASE_TIMEOUT,
                   metavar="SECONDS",
                   help="time limit of one case (all its adapter calls); a case past it is "
                        "an error and the run goes on (its call cannot be stopped and runs "
                        f"on in the background); 0 = no limit (default: {DEFAULT_CASE_TIMEOUT:g})")
    r.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    r.add_argument("--verbose", "-v", action="store_true",
                   help="each failure in full: the case, its numbers, the diagnosis and what "
                        "it means, and where the formula is documented")

    g = sub.add_parser("golden", help="write or check the golden vector files",
                       description="Write the golden vectors from kfac_ref, or check them: "
                                   "sha256 integrity, and agreement of the regenerated "
                                   "catalogue within each case's tolerance.")
    gx = g.add_mutually_exclusive_group(required=True)
    gx.add_argument("--write", action="store_true", help="regenerate from kfac_ref")
    gx.add_argument("--check", action="store_true",
                    help="verify integrity and agreement with the live catalogue")
    g.add_argument("--dir", default=None,
                   help="golden directory (default: the package's conformance/golden)")

    ls = sub.add_parser("list", help="list capabilities, cases and adapters (one line each; "
                                     "`list NAME` for one in full)",
                        description="One line per capability (with the kfac_ref functions it "
                                    "checks) and per adapter; `list NAME` shows a capability, "
                                    "a family, an adapter or a mutant in full.")
    ls.add_argument("name", nargs="?", metavar="NAME",
                    help="a capability (linalg.kron), a family (linalg), an adapter or a "
                         "mutant: show it in full, with its cases")
    ls.add_argument("--cases", action="store_true", help="list every case")
    ls.add_argument("--markdown", action="store_true",
                    help="print the capability table as Markdown (for the README)")

    sub.add_parser("docs", help="regenerate the generated tables in conformance/README.md")

    na = sub.add_parser("new-adapter", help="write a commented adapter skeleton",
                        description="Write NAME_adapter.py: an adapter for the implementation "
                                    "NAME with every capability stubbed as unsupported and "
                                    "every convention field written out with its meaning.")
    na.add_argument("name", metavar="NAME", help="the implementation's (import) name")
    na.add_argument("--out", default=None, metavar="FILE",
                    help="where to write it (default: ./NAME_adapter.py; '-' = stdout)")
    na.add_argument("--force", action="store_true", help="overwrite an existing file")

    m = sub.add_parser("matrix", help="merge report.json files into the ecosystem matrix")
    m.add_argument("reports", nargs="+", help="report.json files")
    m.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                   help=f"where matrix.md/.json go (default: ./{DEFAULT_OUT})")
    p.epilog = _run_options_text(r, prog) + "\n\n" + epilog
    return p


def locate(message: str) -> str:
    """``message`` with the installed location of each ``conformance/...`` file it names that
    is not under the current directory (e.g. a peer's environment recipe)."""
    found = []
    for rel in dict.fromkeys(re.findall(r"conformance/[\w./-]*\w", message)):
        path = _PKG.parent / rel
        if not Path(rel).exists() and path.exists():
            found.append(f"{rel} is {path}")
    return message + (f" ({'; '.join(found)})" if found else "")


def _is_reference(name) -> bool:
    from .adapters import shipped

    return shipped().get(name, "").startswith("conformance.adapters.kfac_ref_adapter")


def _cmd_run(args) -> int:
    try:
        import pytest  # noqa: F401 - the suite's runner (conformance/pytest_plugin.py)
    except ImportError:
        print('error: running the suite needs pytest, its runner: python -m pip install '
              '"pytest>=8" (or kfac_ref[conformance])', file=sys.stderr)
        return 2
    from .adapter import Adapter, AdapterUnavailable, load_adapter
    from .adapters import broken, external, mutants, shipped
    from .reports import Progress, legend, terminal_summary, write_matrix, write_reports
    from .runner import read_pattern_file
    from .suite import run, select_cases

    prog = args.prog
    skips = read_pattern_file(args.skips) if args.skips else None
    xfails = read_pattern_file(args.xfails) if args.xfails else None
    single = None
    if not args.all_adapters:
        # load and set the adapter up before anything is printed: an adapter that cannot
        # run here is a usage error with its reason, not a table of skips
        spec = args.adapter or os.environ.get("KFAC_CONFORMANCE_ADAPTER") or "kfac_ref"
        try:
            single = load_adapter(args.adapter)
            single.setup()
        except AdapterUnavailable as exc:
            print(f"error: adapter {spec!r} is unavailable: {locate(str(exc))}",
                  file=sys.stderr)
            print(locate(f"hint: `{command(prog)} list` shows the adapters; peers run in their "
                         "own environments, see conformance/peers/README.md"), file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken spec, module or setup
            # (SystemExit included: an adapter does not end the run with its own status)
            print(f"error: cannot load adapter {spec!r}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 2
    try:
        cases, absent, label = select_cases(args.source, args.family, args.capability,
                                            args.keyword)
    except Exception as exc:  # noqa: BLE001 - GoldenError, bad source
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.all_adapters:
        specs = dict(shipped())
        specs.update({k: v for k, v in external().items() if k not in specs})
        if args.with_mutants:
            specs.update(mutants())
        for mod, why in broken().items():  # reported as errors, never dropped
            if args.with_mutants or not mod.startswith("conformance.mutants."):
                specs.setdefault(mod.rsplit(".", 1)[1], _BrokenModule(
                    f"adapter module {mod} cannot be imported: {why}"))
    else:
        specs = {single.name: single}
    reports, all_ok, interrupted = [], True, False
    for name, spec in specs.items():
        if single is not None:
            adapter = single
        else:
            try:
                if isinstance(spec, _BrokenModule):
                    raise spec
                adapter = load_adapter(spec)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - unavailable, or a broken adapter
                adapter = Adapter()
                adapter.name = name
                if isinstance(exc, AdapterUnavailable):
                    exc = AdapterUnavailable(str(exc))

                def _fail_setup(exc=exc):
                    raise exc

                adapter.setup = _fail_setup
        self_check = single is not None and _is_reference(adapter.name)
        what = (f" (self-check: kfac_ref against its own "
                f"{'golden vectors' if 'golden' in label else 'live computation'})"
                if self_check else "")
        print(f"== adapter {adapter.name}: {len(cases)} cases{what} ==")
        report = run(adapter, cases=cases, skips=skips, xfails=xfails,
                     progress=Progress(quiet=args.quiet), setup=single is None,
                     case_timeout=args.case_timeout)
        report.absent = absent
        report.source = label
        paths = write_reports(report, args.out)
        if report.unavailable:  # only with --all-adapters: one line, not a table of skips
            print(f"   unavailable here, not compared: {locate(report.unavailable)}")
        else:
            print(terminal_summary(report, with_legend=single is not None,
                                   verbose=args.verbose))
            print("reports: " + ", ".join(str(p) for p in paths.values()))
            if not (args.all_adapters and adapter.name in mutants()):
                all_ok &= report.ok
        reports.append(report.to_dict())
        if report.interrupted:
            print(f"\n{report.interrupted}; the reports hold the cases that ran",
                  file=sys.stderr)
            interrupted = True
            break
        if self_check:
            cmd = command(prog)
            print("next: this was a self-check of the reference.  To check another "
                  f"implementation:\n  {cmd} list             shows the adapters\n"
                  f"  {cmd} --adapter NAME   runs one (a name, a module or a file.py; "
                  "conformance/README.md says how to write an adapter)")
        elif single is not None and not report.ok:
            _failure_hint(report, args, paths)
    if args.all_adapters:
        print(legend())
        write_matrix(reports, args.out)
        print(f"matrix: {Path(args.out) / 'matrix.md'}, {Path(args.out) / 'matrix.json'}")
    if interrupted:
        return EXIT_INTERRUPTED
    return 0 if all_ok else 1


class _BrokenModule(RuntimeError):
    """An adapter module of the suite that cannot be imported (its adapter's run errors)."""


def _failure_hint(report, args, paths) -> None:
    """``next:`` after a failing run: the command that shows its first failure in full, and
    the report to read.  On stderr, with the other hints (stdout is the run's results)."""
    bad = [r for r in report.results if r.status in ("fail", "error")]
    if not bad:  # nothing was compared
        print(f"next: `{command(args.prog)} list` shows the capabilities and their cases",
              file=sys.stderr)
        return
    first = bad[0]
    spec = args.adapter or os.environ.get("KFAC_CONFORMANCE_ADAPTER") or report.adapter.get(
        "name", "")
    parts = [command(args.prog), "--adapter", shlex.quote(str(spec)), "-k",
             shlex.quote(first.case_id), "-v"]
    if args.out != str(DEFAULT_OUT):
        parts[3:3] = ["--out", shlex.quote(args.out)]
    print(f"next: {len(bad)} case(s) failed; the first in full:\n  {' '.join(parts)}\n"
          f"  every case, with its diagnosis: {paths['html']} (open in a browser) or "
          f"{paths['markdown']}", file=sys.stderr)


def _cmd_golden(args) -> int:
    from .catalogue import build_catalogue, capabilities
    from .golden import GOLDEN_DIR, check_golden, write_golden
    from .results import environment

    directory = Path(args.dir) if args.dir else GOLDEN_DIR
    cases, absent = build_catalogue()
    if args.write:
        env = environment()
        manifest = write_golden(cases, capabilities(), directory,
                                extra={"kfac_ref": env["kfac_ref"], "numpy": env["numpy"],
                                       "absent_families": absent})
        total = sum(f["bytes"] for f in manifest["files"].values())
        print(f"wrote {len(manifest['cases'])} cases in {len(manifest['files'])} files "
              f"({total / 1024:.1f} KiB) to {directory}")
        for fam, why in absent.items():
            print(f"  absent family {fam}: {why}")
        return 0
    problems = check_golden(cases, directory)
    for p in problems:
        print(p)
    print("golden files OK" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1


def _fit(text: str, width: int = LIST_WIDTH) -> str:
    """``text`` cut to ``width`` columns (… when cut)."""
    return text if len(text) <= width else text[:width - 1].rstrip() + "…"


def _short_function(name: str) -> str:
    """A checked function's name for a one-line listing: ``kron()`` for
    ``kfac_ref.linalg.kron``, a method with its class (``BlockDiagonalCurvature.
    to_dense_matrix()``), a class as it is (``list NAME`` gives the full paths)."""
    parts = name.split(".")
    cls = next((i for i, p in enumerate(parts) if p[:1].isupper()), None)
    if cls is not None and cls == len(parts) - 1:
        return parts[-1]
    return ".".join(parts[cls if cls is not None else -1:]) + "()"


def _cmd_list(args) -> int:
    from .adapters import mutants
    from .catalogue import FAMILY_MODULES, FUNCTIONS, build_catalogue, capabilities, family_status

    caps = capabilities()
    if args.markdown:
        print("| capability | what the adapter returns | inputs / params | conventions |")
        print("|---|---|---|---|")
        for name, cap in caps.items():
            conv = ", ".join(c for c in cap.conventions if c != "symmetrised") or "—"
            print(f"| `{name}` | {cap.summary} | {cap.signature} | {conv} |")
        return 0
    if args.name:
        return _list_one(args)
    cmd = command(args.prog)
    cases, absent = build_catalogue() if args.cases else ([], {})
    width = max(len(n) for n in caps)
    print("capabilities, each with the kfac_ref function(s) whose numbers it checks")
    print(_fit(f"(`{cmd} list NAME`: one of them, a family or an adapter in full):"))
    for fam in FAMILY_MODULES:
        ok, why = family_status(fam)
        print(_fit(f"[{fam}] " + ("available" if ok else f"absent: {why}")))
        for name, cap in caps.items():
            if cap.family == fam:
                checks = ", ".join(dict.fromkeys(
                    _short_function(f) for f in FUNCTIONS.get(name, ()) if "." in f
                    and f.startswith("kfac_ref.")))
                print(_fit(f"  {name:<{width}}  {checks or cap.summary}"))
                for c in cases:
                    if c.capability == name:
                        print(_fit(f"      {c.id}  rtol64={c.tolerance.rtol():.1e} "
                                   f"({c.tolerance.derivation})"))
    print("adapters (--adapter NAME; declared conventions: where each differs from the "
          "reference):")
    print("\n".join(_adapter_lines(conventions=True, width=LIST_WIDTH)))
    print(textwrap.fill("mutants (deliberately wrong adapters that test the diagnosis; "
                        "`list NAME` shows one's pitfall): " + ", ".join(mutants()),
                        width=LIST_WIDTH, subsequent_indent="  ", break_on_hyphens=False))
    return 0


def _wrap(label: str, text: str) -> str:
    return textwrap.fill(text, width=LIST_WIDTH, initial_indent=f"  {label:<13}",
                         subsequent_indent=" " * 15, break_on_hyphens=False,
                         break_long_words=False)


def _list_one(args) -> int:
    """``list NAME``: a capability, a family, an adapter or a mutant in full."""
    import difflib

    from .adapter import load_adapter
    from .adapters import external, mutants, shipped
    from .catalogue import FAMILY_MODULES, build_catalogue, capabilities, describe_functions

    caps = capabilities()
    name = args.name
    if name in caps:
        names = [name]
    elif name in FAMILY_MODULES:
        names = [n for n, c in caps.items() if c.family == name]
    else:
        names = []
    if names:
        fam = caps[names[0]].family
        cases, absent = build_catalogue([fam])
        for n in names:
            cap = caps[n]
            print(n)
            print(_wrap("checks:", describe_functions(n) or "(no kfac_ref function listed)"))
            print(_wrap("returns:", cap.summary))
            print(_wrap("inputs:", cap.signature))
            print(_wrap("conventions:", ", ".join(cap.conventions) or "none (canonical only)"))
            mine = [c for c in cases if c.capability == n]
            print(f"  cases ({len(mine)}):" if mine else
                  f"  cases: none here ({absent.get(fam, 'the family built no case')})")
            for c in mine:
                print(_fit(f"    {c.id}  rtol64={c.tolerance.rtol():.1e}"))
                print(textwrap.fill(c.tolerance.derivation, width=LIST_WIDTH,
                                    initial_indent="      ", subsequent_indent="      "))
        return 0
    adapters = {**shipped(), **external(), **mutants()}
    if name in adapters:
        try:
            adapter = load_adapter(name)
        except Exception as exc:  # noqa: BLE001 - a broken adapter module is shown as such
            print(f"{name}: cannot be loaded: {type(exc).__name__}: {exc}")
            return 1
        print(name)
        print(_wrap("what:", adapter.description))
        print(_wrap("conventions:", _conventions_text(adapter)))
        if name in mutants():
            print(_wrap("pitfall:", str(getattr(adapter, "pitfall", ""))))
            expected = getattr(adapter, "EXPECTED", {})
            print(_wrap("expected:", ", ".join(f"{c} → {p}" for c, p in expected.items())))
        unsupported = sorted(getattr(adapter, "unsupported", ()) or ())
        if unsupported:
            print(_wrap("unsupported:", ", ".join(unsupported)))
        print(f"  run it: {command(args.prog)} --adapter {name}")
        return 0
    known = [*caps, *FAMILY_MODULES, *adapters]
    close = difflib.get_close_matches(name, known, n=3)
    print(f"error: no capability, family, adapter or mutant is called {name!r}"
          + (f"; did you mean {', '.join(close)}?" if close else "")
          + f" (`{command(args.prog)} list` shows them all)", file=sys.stderr)
    return 2


def readme_tables() -> dict:
    """The generated sections of README.md: name -> Markdown."""
    from .adapter import load_adapter
    from .adapters import mutants
    from .catalogue import capabilities
    from .conventions import CANONICAL, FIELDS
    from .diagnosis import DOCS, DOCS_PAGES, PITFALLS

    caps = ["| capability | what the adapter returns | inputs / params | conventions |",
            "|---|---|---|---|"]
    for name, cap in capabilities().items():
        conv = ", ".join(c for c in cap.conventions if c != "symmetrised") or "—"
        caps.append(f"| `{name}` | {cap.summary} | {cap.signature} | {conv} |")
    conv = ["| field | values | reference | meaning |", "|---|---|---|---|"]
    for k, (allowed, meaning) in FIELDS.items():
        vals = ", ".join(repr(a) for a in allowed) if allowed else "None or a number"
        conv.append(f"| `{k}` | {vals} | `{getattr(CANONICAL, k)!r}` | {meaning} |")
    pits = ["| id | pitfall | formula (docs page › section) | evidence |", "|---|---|---|---|"]
    for k, (title, text, ref) in PITFALLS.items():
        page, section = DOCS.get(k, ("", ""))
        where = f"{DOCS_PAGES[page]} › {section}" if page else ""
        pits.append(f"| `{k}` | {title}: {text} | {where} | {ref} |")
    muts = ["| mutant | pitfall built in | capability → expected diagnosis |", "|---|---|---|"]
    for n in sorted(mutants()):
        a = load_adapter(n)
        exp = ", ".join(f"`{c}` → `{p}`" for c, p in a.EXPECTED.items())
        muts.append(f"| `{n}` | {a.pitfall} | {exp} |")
    return {"capabilities": "\n".join(caps), "conventions": "\n".join(conv),
            "pitfalls": "\n".join(pits), "mutants": "\n".join(muts)}


def _cmd_docs(args) -> int:
    import re

    path = Path(__file__).parent / "README.md"
    text = path.read_text(encoding="utf-8")
    for name, body in readme_tables().items():
        pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
        text, n = pattern.subn(lambda m, body=body: m.group(1) + body + "\n" + m.group(2),
                               text)
        if n != 1:
            print(f"README.md has no generated section {name!r}", file=sys.stderr)
            return 1
    path.write_text(text, encoding="utf-8")
    print(f"updated {path}")
    return 0


def _cmd_new_adapter(args) -> int:
    from .skeleton import adapter_skeleton

    try:
        text = adapter_skeleton(args.name)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    path = Path(args.out or f"{args.name}_adapter.py")
    if path.exists() and not args.force:
        print(f"error: {path} exists (--force overwrites it)", file=sys.stderr)
        return 2
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}: every capability is listed as unsupported; implement one, delete "
          f"its line from `unsupported`, then run\n  {command(args.prog)} --adapter {path}")
    return 0


def _cmd_matrix(args) -> int:
    from .reports import write_matrix

    reps = [json.loads(Path(p).read_text(encoding="utf-8")) for p in args.reports]
    write_matrix(reps, args.out)
    print(f"matrix: {Path(args.out) / 'matrix.md'}")
    return 0


def main(argv=None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS + ("-h", "--help", "--version"):
        argv = ["run", *argv]
    args = _parser(prog).parse_args(argv)
    args.prog = prog
    os.environ.setdefault("PYTHONHASHSEED", "0")
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:  # outside a run's cases (those write a partial report)
        print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED


_COMMANDS = {"run": _cmd_run, "golden": _cmd_golden, "list": _cmd_list,
             "matrix": _cmd_matrix, "docs": _cmd_docs, "new-adapter": _cmd_new_adapter}


def script() -> int:
    """Entry point of the ``kfac-conformance`` console script."""
    return main(prog=SCRIPT)


if __name__ == "__main__":
    sys.exit(main())
