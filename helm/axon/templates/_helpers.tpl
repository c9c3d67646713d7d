{{/* Names ------------------------------------------------------------------------------------ */}}
{{- define "axon.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "axon.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: (dict "ctx" $ "component" "gateway") */}}
{{- define "axon.componentName" -}}
{{- printf "%s-%s" (include "axon.fullname" .ctx | trunc 40 | trimSuffix "-") .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "axon.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "axon.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels: (dict "ctx" $ "component" "gateway" ["pool" "default"]) -------------------------------- */}}
{{- define "axon.selectorLabels" -}}
app.kubernetes.io/name: {{ include "axon.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .pool }}
axon.io/pool: {{ .pool }}
{{- end }}
{{- end -}}

{{- define "axon.labels" -}}
{{ include "axon.selectorLabels" . }}
app.kubernetes.io/part-of: axon
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Image reference: (dict "ctx" $ "image" .Values.images.app) */}}
{{- define "axon.image" -}}
{{- $images := .ctx.Values.images -}}
{{- $tag := .image.tag | default $images.tag | default .ctx.Chart.AppVersion -}}
{{- if $images.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $images.registry) .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Required values ------------------------------------------------------------------------------ */}}
{{- define "axon.validate" -}}
{{- $s := .Values.secrets -}}
{{- $_ := required "secrets.redisUrl.name is required: an existing Secret holding AXON_REDIS_URL" $s.redisUrl.name -}}
{{- $_ := required "secrets.amqpUrl.name is required: an existing Secret holding AXON_AMQP_URL" $s.amqpUrl.name -}}
{{- $_ := required "secrets.databaseUrl.name is required: an existing Secret holding AXON_DATABASE_URL" $s.databaseUrl.name -}}
{{- $_ := required "secrets.adminToken.name is required: an existing Secret holding AXON_ADMIN_TOKEN" $s.adminToken.name -}}
{{- $_ := required "secrets.internalToken.name is required: an existing Secret holding AXON_INTERNAL_TOKEN (at least 32 characters)" $s.internalToken.name -}}
{{- if and .Values.ingress.enabled (not .Values.ingress.certificateArn) -}}
{{- fail "ingress.certificateArn is required when ingress.enabled: the ALB serves HTTPS with an ACM certificate" -}}
{{- end -}}
{{- if and (eq .Values.files.store "s3") (not .Values.files.s3.bucket) -}}
{{- fail "files.s3.bucket is required when files.store is s3: the bucket the files' bytes go to" -}}
{{- end -}}
{{- end -}}

{{/* Env ------------------------------------------------------------------------------------------ */}}
{{/* A list of env vars from a map, sorted by name. */}}
{{- define "axon.envFromMap" -}}
{{- range $name := keys . | sortAlpha }}
- name: {{ $name }}
  value: {{ get $ $name | toString | quote }}
{{- end }}
{{- end -}}

{{/* One env var from a Secret key: (dict "name" "AXON_REDIS_URL" "ref" .Values.secrets.redisUrl) */}}
{{- define "axon.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .ref.name }}
      key: {{ .ref.key }}
{{- end -}}

{{/* Settings every process shares, merged with a component's own map and its fixed settings:
     (dict "ctx" $ "env" .Values.gateway.env "fixed" (dict "AXON_GATEWAY_PORT" "8000")) */}}
{{- define "axon.env" -}}
{{- $env := include "axon.tracingEnv" .ctx | fromYaml | default dict -}}
{{- $env = mergeOverwrite $env (deepCopy (.ctx.Values.config.env | default dict)) -}}
{{- $env = mergeOverwrite $env (deepCopy (.env | default dict)) -}}
{{- $env = mergeOverwrite $env (dict "AXON_NAMESPACE" .ctx.Values.config.namespace) -}}
{{- $env = mergeOverwrite $env (.fixed | default dict) -}}
{{- include "axon.envFromMap" $env | trim -}}
{{- end -}}

{{/* Traces: AXON_OTLP_ENDPOINT (tracing.endpoint, else the chart's collector when enabled) and
     AXON_TRACE_SAMPLE_RATIO, for every process; nothing when neither is set. A component's env
     and config.env may override them. */}}
{{- define "axon.otlpEndpoint" -}}
{{- $t := .Values.tracing -}}
{{- if $t.endpoint -}}
{{- $t.endpoint -}}
{{- else if $t.collector.enabled -}}
{{- printf "http://%s:%d" (include "axon.componentName" (dict "ctx" . "component" "otel-collector")) (int $t.collector.httpPort) -}}
{{- end -}}
{{- end -}}

{{- define "axon.tracingEnv" -}}
{{- $endpoint := include "axon.otlpEndpoint" . -}}
{{- if $endpoint -}}
AXON_OTLP_ENDPOINT: {{ $endpoint | quote }}
AXON_TRACE_SAMPLE_RATIO: {{ .Values.tracing.sampleRatio | toString | quote }}
{{- end -}}
{{- end -}}

{{/* Pod pieces ----------------------------------------------------------------------------------- */}}
{{- define "axon.podSecurity" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
serviceAccountName: {{ include "axon.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Liveness on /health, readiness on /ready, both on the named port "http". */}}
{{- define "axon.probes" -}}
livenessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 6
readinessProbe:
  httpGet:
    path: /ready
    port: http
  periodSeconds: {{ .periodSeconds | default 5 }}
  timeoutSeconds: 5
  failureThreshold: {{ .failureThreshold | default 3 }}
{{- end -}}

{{/* Soft spread over zones and nodes: (dict "ctx" $ "component" "gateway") */}}
{{- define "axon.zoneSpread" -}}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: topology.kubernetes.io/zone
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "axon.selectorLabels" . | nindent 8 }}
  - maxSkew: 1
    topologyKey: kubernetes.io/hostname
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "axon.selectorLabels" . | nindent 8 }}
{{- end -}}

{{/* A worker pool's values: worker.defaults overridden by worker.pools.<name>. (dict "ctx" $ "name" "default") */}}
{{- define "axon.workerPool" -}}
{{- $pool := mergeOverwrite (deepCopy .ctx.Values.worker.defaults) (deepCopy (get .ctx.Values.worker.pools .name)) -}}
{{- toYaml $pool -}}
{{- end -}}
