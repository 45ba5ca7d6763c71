from mmis.cli import main

raise SystemExit(main())
