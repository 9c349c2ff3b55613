"""Command line: ``python -m conformance`` or ``kfac-conformance`` (see README.md).

``main(argv, prog)`` is the whole program; ``prog`` is how the user invoked it, so that help
and hints show the command they typed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
     here (not installed), golden files that cannot be read"""


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


def _adapter_lines(conventions: bool = False) -> list[str]:
    """One line per shipped and external (entry-point) adapter: name and description; with
    ``conventions``, a second line with its declared conventions."""
    from .adapter import load_adapter
    from .adapters import ENTRY_POINT_GROUP, distribution_of, external, shipped

    rows = []
    ext = external()
    for name in [*shipped(), *ext]:
        conv = ""
        try:
            adapter = load_adapter(name)
            desc = adapter.description
            conv = _conventions_text(adapter)
        except Exception as exc:  # noqa: BLE001 - a broken adapter module is listed as such
            desc = f"(cannot be loaded: {type(exc).__name__}: {exc})"
        if name in ext:
            dist = distribution_of(name)
            desc += f" [entry point {ENTRY_POINT_GROUP}" + (f" of {dist}]" if dist else "]")
        rows.append((name, desc, conv))
    width = max(len(n) for n, _, _ in rows)
    out = []
    for n, d, c in rows:
        out.append(f"  {n:<{width}}  {d}")
        if conventions and c:
            out.append(f"  {'':<{width}}    conventions: {c}")
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
    r.add_argument("--quiet", "-q", action="store_true", help="no progress output")

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

    ls = sub.add_parser("list", help="list capabilities, cases and adapters")
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
    from .adapter import Adapter, AdapterUnavailable, load_adapter
    from .adapters import external, mutants, shipped
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
            print(locate(f"hint: `{prog} list` shows the adapters; peers run in their own "
                         "environments, see conformance/peers/README.md"), file=sys.stderr)
            return 2
        except Exception as exc:  # noqa: BLE001 - a broken spec, module or setup
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
    else:
        specs = {single.name: single}
    reports, all_ok = [], True
    for name, spec in specs.items():
        if single is not None:
            adapter = single
        else:
            try:
                adapter = load_adapter(spec)
            except AdapterUnavailable as exc:
                adapter = Adapter()
                adapter.name = name

                def _fail_setup(exc=exc):
                    raise AdapterUnavailable(str(exc))

                adapter.setup = _fail_setup
        self_check = single is not None and _is_reference(adapter.name)
        what = (f" (self-check: kfac_ref against its own "
                f"{'golden vectors' if 'golden' in label else 'live computation'})"
                if self_check else "")
        print(f"== adapter {adapter.name}: {len(cases)} cases{what} ==")
        report = run(adapter, cases=cases, skips=skips, xfails=xfails,
                     progress=Progress(quiet=args.quiet), setup=single is None)
        report.absent = absent
        report.source = label
        paths = write_reports(report, args.out)
        if report.unavailable:  # only with --all-adapters: one line, not a table of skips
            print(f"   unavailable here, not compared: {locate(report.unavailable)}")
        else:
            print(terminal_summary(report, with_legend=single is not None))
            print("reports: " + ", ".join(str(p) for p in paths.values()))
            if not (args.all_adapters and adapter.name in mutants()):
                all_ok &= report.ok
        reports.append(report.to_dict())
        if self_check:
            print("next: this was a self-check of the reference.  To check another "
                  f"implementation:\n  {prog} list             shows the adapters\n"
                  f"  {prog} --adapter NAME   runs one (a name, a module or a file.py; "
                  "conformance/README.md says how to write an adapter)")
    if args.all_adapters:
        print(legend())
        write_matrix(reports, args.out)
        print(f"matrix: {Path(args.out) / 'matrix.md'}, {Path(args.out) / 'matrix.json'}")
    return 0 if all_ok else 1


def _cmd_golden(args) -> int:
    from .catalogue import build_catalogue, capabilities
    from .golden import GOLDEN_DIR, check_golden, write_golden
    from .runner import environment

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


def _cmd_list(args) -> int:
    from .adapters import mutants
    from .catalogue import FAMILY_MODULES, build_catalogue, capabilities, family_status

    caps = capabilities()
    if args.markdown:
        print("| capability | what the adapter returns | inputs / params | conventions |")
        print("|---|---|---|---|")
        for name, cap in caps.items():
            conv = ", ".join(c for c in cap.conventions if c != "symmetrised") or "—"
            print(f"| `{name}` | {cap.summary} | {cap.signature} | {conv} |")
        return 0
    cases, absent = build_catalogue() if args.cases else ([], {})
    for fam in FAMILY_MODULES:
        ok, why = family_status(fam)
        print(f"[{fam}] " + ("available" if ok else f"absent: {why}"))
        for name, cap in caps.items():
            if cap.family == fam:
                conv = f" (conventions: {', '.join(cap.conventions)})" if cap.conventions else ""
                print(f"  {name}: {cap.summary}{conv}")
                for c in cases:
                    if c.capability == name:
                        print(f"      {c.id}  rtol64={c.tolerance.rtol():.1e} "
                              f"({c.tolerance.derivation})")
    print("adapters (--adapter NAME; declared conventions: where each differs from the "
          "reference):")
    print("\n".join(_adapter_lines(conventions=True)))
    print("mutants (deliberately wrong adapters that test the diagnosis): " +
          ", ".join(mutants()))
    return 0


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
          f"its line from `unsupported`, then run\n  {args.prog} --adapter {path}")
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
    return {"run": _cmd_run, "golden": _cmd_golden, "list": _cmd_list,
            "matrix": _cmd_matrix, "docs": _cmd_docs,
            "new-adapter": _cmd_new_adapter}[args.command](args)


def script() -> int:
    """Entry point of the ``kfac-conformance`` console script."""
    return main(prog=SCRIPT)


if __name__ == "__main__":
    sys.exit(main())
