// mmis-epp: the Gateway API Inference Extension's endpoint picker (v1.5.0's runner) with the
// mmis cache scorer registered (pkg/mmiscache; docs/ROUTING.md). Flags and configuration are
// the framework's; operator/mmis_operator/routing.py writes the configuration.
package main

import (
	"os"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/gateway-api-inference-extension/cmd/epp/runner"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"

	"mmis.dev/router/pkg/mmiscache"
)

func main() {
	plugin.Register(mmiscache.Type, mmiscache.Factory)
	if err := runner.NewRunner().Run(ctrl.SetupSignalHandler()); err != nil {
		os.Exit(1)
	}
}
