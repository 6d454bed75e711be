"""python -m sparseforge {info,demo}"""

import sys


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else "info"
    if command == "info":
        from sparseforge.info import main as run
    elif command == "demo":
        from sparseforge.demo import main as run
    else:
        print("usage: python -m sparseforge {info,demo}", file=sys.stderr)
        return 2
    return run()


if __name__ == "__main__":
    sys.exit(main())
