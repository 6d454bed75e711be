"""python -m sparseforge {info [--selftest],demo}"""

import sys


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else "info"
    if command == "info":
        from sparseforge.info import main as info

        return info(args[1:])
    if command == "demo":
        from sparseforge.demo import main as demo

        return demo()
    print("usage: python -m sparseforge {info [--selftest],demo}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
