"""`@file` argument files: flags read like a shell script's (several per line, '#' comments), for
the launcher and the example's parser alike, before anything heavy is imported."""


def arg_file_line(line: str) -> list[str]:
    """Several flags per line, '#' comments: argument files read like shell scripts."""
    return line.split("#", 1)[0].split()


def expand_arg_files(argv: list[str]) -> list[str]:
    """`@file` arguments replaced by the flags in the file (recursively)."""
    out = []
    for arg in argv:
        if arg.startswith("@"):
            with open(arg[1:], encoding="utf-8") as f:
                out += expand_arg_files([a for line in f for a in arg_file_line(line)])
        else:
            out.append(arg)
    return out
