from stratagem.cli import main

raise SystemExit(main())
