{{/* Names, labels and the operator's RBAC rules (one place for ClusterRole and Role). */}}

{{- define "mmis.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mmis.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "mmis.name" .) .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s-operator" .Release.Name (include "mmis.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mmis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mmis.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mmis.labels" -}}
{{ include "mmis.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mmis
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The endpoint picker's ClusterRole (routing.enabled): the operator binds it per resource. */}}
{{- define "mmis.pickerClusterRole" -}}
{{- printf "%s-picker" (include "mmis.fullname" .) -}}
{{- end -}}

{{/* The operator's pod labels as KEY=VALUE,... (its --operator-pod-labels). */}}
{{- define "mmis.selectorLabelPairs" -}}
{{- $pairs := list -}}
{{- range $key, $value := (include "mmis.selectorLabels" . | fromYaml) -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{- define "mmis.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mmis.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* What the operator touches inside a watched namespace: only what it reads or writes
itself. It grants nothing it holds: the picker's rights are the picker's ClusterRole, which
the operator may only bind (routing.enabled). No configmaps, roles, leases, and Secrets
create-only. tests/security/test_rbac.py reads the rendered rules. */}}
{{- define "mmis.namespacedRules" -}}
- apiGroups: [mmis.dev]
  resources: [mminferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [mmis.dev]
  resources: [mminferenceservices/status]
  verbs: [get, update, patch]
- apiGroups: [mmis.dev]
  resources: [mminferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [ingresses]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
# the model cache claim the operator creates (spec.model.storage)
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create, patch, delete]
# spec.autoscaling: an HPA on the resource's scale subresource, or a KEDA ScaledObject
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
# spec.monitoring: a PodMonitor per resource (prometheus-operator)
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch, delete]
# NetworkPolicies per resource (networkPolicy.enabled; deleted again when it is turned off)
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
# the conditions' transitions, as Events on the resource
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.routing.enabled }}
# spec.routing: an InferencePool and its endpoint picker (a Deployment and a Service, above;
# its ServiceAccount and a RoleBinding to the picker's ClusterRole, which the operator may
# bind and nothing more), and the internal token's Secret: create only, never read, changed,
# listed or deleted (garbage collection deletes it with the resource)
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [rolebindings]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [clusterroles]
  verbs: [bind]
  resourceNames: [{{ include "mmis.pickerClusterRole" . }}]
{{- end }}
{{- if or .Values.routing.enabled (.Values.encoder | default dict).enabled (.Values.adapters | default dict).enabled }}
# the internal token's Secret NAME-internal (spec.routing: the picker's; spec.encoder: the
# encoders' and front ends' MMIS_ENCODER_TOKEN; spec.adapters: P0's, for the operator's
# calls): create only, never read, changed, listed or deleted (garbage collection deletes it
# with the resource)
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
{{- end }}
# the CacheCoherent probe finds ready pods and their IPs; status reads their container states
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- if .Values.peering.enabled }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}
