"""python -m kernels.bench"""

from .runner import main

if __name__ == "__main__":
    main()
