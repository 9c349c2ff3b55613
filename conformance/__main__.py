"""Command line: ``python -m conformance [run|golden|list|matrix] ...`` (see README.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).parent / "_out"
COMMANDS = ("run", "golden", "list", "matrix", "docs")


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Check a K-FAC implementation against the kfac_ref reference.")
    sub = p.add_subparsers(dest="command")

    r = sub.add_parser("run", help="run the suite against one adapter (the default command)")
    r.add_argument("--adapter", "-a", default=None,
                   help="adapter name, module[:attr] or file.py (default: "
                        "$KFAC_CONFORMANCE_ADAPTER or kfac_ref)")
    r.add_argument("--all-adapters", action="store_true",
                   help="run every shipped adapter and write the ecosystem matrix")
    r.add_argument("--with-mutants", action="store_true",
                   help="with --all-adapters: include the deliberately wrong adapters")
    r.add_argument("--source", choices=("auto", "live", "golden"), default="auto",
                   help="expected values: golden files (+ live cases they lack), live "
                        "kfac_ref, or the golden files only (default auto)")
    r.add_argument("--family", action="append", help="restrict to a family (repeatable)")
    r.add_argument("--capability", "-c", action="append",
                   help="restrict to capabilities (fnmatch pattern, repeatable)")
    r.add_argument("-k", dest="keyword", help="restrict to case ids containing this string")
    r.add_argument("--skips", help="file of case-id/capability patterns to skip")
    r.add_argument("--xfails", help="file of case-id/capability patterns expected to fail")
    r.add_argument("--out", default=str(DEFAULT_OUT),
                   help="report directory (default conformance/_out)")
    r.add_argument("--quiet", "-q", action="store_true", help="no progress output")

    g = sub.add_parser("golden", help="write or check the golden vector files")
    gx = g.add_mutually_exclusive_group(required=True)
    gx.add_argument("--write", action="store_true", help="regenerate from kfac_ref")
    gx.add_argument("--check", action="store_true",
                    help="verify integrity and agreement with the live catalogue")
    g.add_argument("--dir", default=None, help="golden directory (default conformance/golden)")

    ls = sub.add_parser("list", help="list capabilities, cases and adapters")
    ls.add_argument("--cases", action="store_true", help="list every case")
    ls.add_argument("--markdown", action="store_true",
                    help="print the capability table as Markdown (for the README)")

    sub.add_parser("docs", help="regenerate the generated tables in conformance/README.md")

    m = sub.add_parser("matrix", help="merge report.json files into the ecosystem matrix")
    m.add_argument("reports", nargs="+", help="report.json files")
    m.add_argument("--out", default=str(DEFAULT_OUT))
    return p


def _cmd_run(args) -> int:
    from .adapter import AdapterUnavailable, load_adapter
    from .adapters import mutants, shipped
    from .reports import Progress, terminal_summary, write_matrix, write_reports
    from .runner import read_pattern_file
    from .suite import run, select_cases

    skips = read_pattern_file(args.skips) if args.skips else None
    xfails = read_pattern_file(args.xfails) if args.xfails else None
    if not args.all_adapters:
        try:
            load_adapter(args.adapter)
        except Exception as exc:  # noqa: BLE001 - AdapterUnavailable or a broken spec
            print(f"error: cannot load adapter: {exc}", file=sys.stderr)
            return 2
    try:
        cases, absent, label = select_cases(args.source, args.family, args.capability,
                                            args.keyword)
    except Exception as exc:  # noqa: BLE001 - GoldenError, bad source
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.all_adapters:
        specs = dict(shipped())
        if args.with_mutants:
            specs.update(mutants())
    else:
        specs = {None: args.adapter}
    reports, all_ok = [], True
    for name, spec in specs.items():
        try:
            adapter = load_adapter(spec)
        except AdapterUnavailable as exc:
            if not args.all_adapters:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            from .adapter import Adapter

            adapter = Adapter()
            adapter.name = name

            def _fail_setup(exc=exc):
                raise AdapterUnavailable(str(exc))

            adapter.setup = _fail_setup
        print(f"== adapter {adapter.name}: {len(cases)} cases ==")
        report = run(adapter, cases=cases, skips=skips, xfails=xfails,
                     progress=Progress(quiet=args.quiet))
        report.absent = absent
        report.source = label
        print(terminal_summary(report))
        paths = write_reports(report, args.out)
        if report.unavailable and not args.all_adapters:
            print(f"error: adapter unavailable: {report.unavailable}", file=sys.stderr)
            return 2
        print("reports: " + ", ".join(str(p) for p in paths.values()))
        reports.append(report.to_dict())
        if not report.unavailable:
            all_ok &= report.ok if not (args.all_adapters and adapter.name in mutants()) \
                else True
        elif not args.all_adapters:
            all_ok = False
    if args.all_adapters:
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
    from .adapters import mutants, shipped
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
    print("adapters: " + ", ".join(shipped()))
    print("mutants:  " + ", ".join(mutants()))
    return 0


def readme_tables() -> dict:
    """The generated sections of README.md: name -> Markdown."""
    from .adapter import load_adapter
    from .adapters import mutants
    from .catalogue import capabilities
    from .conventions import CANONICAL, FIELDS
    from .diagnosis import PITFALLS

    caps = ["| capability | what the adapter returns | inputs / params | conventions |",
            "|---|---|---|---|"]
    for name, cap in capabilities().items():
        conv = ", ".join(c for c in cap.conventions if c != "symmetrised") or "—"
        caps.append(f"| `{name}` | {cap.summary} | {cap.signature} | {conv} |")
    conv = ["| field | values | reference | meaning |", "|---|---|---|---|"]
    for k, (allowed, meaning) in FIELDS.items():
        vals = ", ".join(repr(a) for a in allowed) if allowed else "None or a number"
        conv.append(f"| `{k}` | {vals} | `{getattr(CANONICAL, k)!r}` | {meaning} |")
    pits = ["| id | pitfall | evidence |", "|---|---|---|"]
    for k, (title, text, ref) in PITFALLS.items():
        pits.append(f"| `{k}` | {title}: {text} | {ref} |")
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


def _cmd_matrix(args) -> int:
    from .reports import write_matrix

    reps = [json.loads(Path(p).read_text(encoding="utf-8")) for p in args.reports]
    write_matrix(reps, args.out)
    print(f"matrix: {Path(args.out) / 'matrix.md'}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["run", *argv]
    args = _parser().parse_args(argv)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    return {"run": _cmd_run, "golden": _cmd_golden, "list": _cmd_list,
            "matrix": _cmd_matrix, "docs": _cmd_docs}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
