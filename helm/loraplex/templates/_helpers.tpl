{{/* Names and labels. */}}
{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplex.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraplex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "loraplex.labels" -}}
helm.sh/chart: {{ include "loraplex.chart" . }}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplex
{{- end }}

{{- define "loraplex.serverLabels" -}}
{{ include "loraplex.labels" . }}
app.kubernetes.io/component: server
{{- end }}

{{- define "loraplex.serverSelectorLabels" -}}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{/*
The metrics Service (metrics-service.yaml): the pods' Prometheus ports only, always ClusterIP.
Its component label (metrics) is what the ServiceMonitor selects; the client Services carry
component server, so they are never scraped and never carry the metrics ports.
*/}}
{{- define "loraplex.metricsServiceName" -}}
{{- include "loraplex.suffixed" (list (include "loraplex.fullname" .) "metrics") }}
{{- end }}

{{- define "loraplex.metricsServiceSelectorLabels" -}}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/component: metrics
{{- end }}

{{- define "loraplex.metricsServiceLabels" -}}
{{ include "loraplex.labels" . }}
app.kubernetes.io/component: metrics
{{- end }}

{{/*
<base>-<suffix> within 63 characters (a DNS-1035 label): the base is cut, never the suffix,
so names stay distinct at any release name length. Called with (list BASE SUFFIX).
*/}}
{{- define "loraplex.suffixed" -}}
{{- $suffix := index . 1 }}
{{- printf "%s-%s" (index . 0 | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix }}
{{- end }}

{{/*
The bundled Redis's StatefulSet and Service: at most 52 characters, since the StatefulSet's
pods carry a controller-revision-hash label "<name>-<hash>" that must fit in 63.
*/}}
{{- define "loraplex.redisName" -}}
{{- printf "%s-redis" (include "loraplex.fullname" . | trunc 46 | trimSuffix "-") }}
{{- end }}

{{- define "loraplex.redisSelectorLabels" -}}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loraplex.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraplex.serverImage" -}}
{{- printf "%s:%s" .Values.image.server.repository (default .Chart.AppVersion .Values.image.server.tag) }}
{{- end }}

{{- define "loraplex.storeImage" -}}
{{- printf "%s:%s" .Values.image.store.repository (default .Chart.AppVersion .Values.image.store.tag) }}
{{- end }}

{{/* Paths inside the pod. */}}
{{- define "loraplex.modelMount" -}}/models{{- end }}
{{- define "loraplex.scriptsMount" -}}/opt/loraplex/scripts{{- end }}

{{/* The path the server loads (LORAPLEX_MODEL); empty for the embedded default. */}}
{{- define "loraplex.modelPath" -}}
{{- if ne .Values.model.source "embedded" }}
{{- $path := trimPrefix "/" .Values.model.path }}
{{- if $path }}{{ printf "%s/%s" (include "loraplex.modelMount" .) $path }}{{ else }}{{ include "loraplex.modelMount" . }}{{ end }}
{{- end }}
{{- end }}

{{/* "true" when the model is a Hugging Face folder whose config.json the sidecar can read. */}}
{{- define "loraplex.modelIsHfFolder" -}}
{{- $m := .Values.model }}
{{- if and (ne $m.source "embedded") (or (eq $m.format "hf") (and (eq $m.format "auto") (not (hasSuffix ".gguf" (lower $m.path))))) }}true{{ end }}
{{- end }}

{{/* How many seconds the pod may take to stop: preStop delay, drain, then a margin. */}}
{{- define "loraplex.terminationGracePeriod" -}}
{{- $s := .Values.server }}
{{- add $s.preStopDelaySeconds $s.drainSeconds $s.shutdownMarginSeconds }}
{{- end }}

{{/* The Redis URL when it is not in a Secret; empty for redis.mode=none or a Secret URL. */}}
{{- define "loraplex.redisUrl" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- printf "redis://%s:6379/0" (include "loraplex.redisName" .) }}
{{- else if and (eq .Values.redis.mode "external") (not .Values.redis.external.existingSecret) }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* AWS credentials from the existing Secret (nothing when the pod identity is used). */}}
{{- define "loraplex.s3CredentialEnv" -}}
{{- $c := .Values.s3.credentials }}
{{- if $c.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.secretAccessKeyKey }}
{{- if $c.sessionTokenKey }}
- name: AWS_SESSION_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.sessionTokenKey }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Checks across values that values.schema.json cannot express. Each failure names the
values to change.
*/}}
{{- define "loraplex.validate" -}}
{{- $v := .Values }}
{{- /* The server runs on one device: the chart sets no LORAPLEX_TENSOR_PARALLEL, so more GPUs would sit idle. */}}
{{- if ne (int $v.gpu.count) 1 }}
{{- fail (printf "gpu.count=%v: the server runs on one GPU (the chart starts it without tensor parallelism), so the pod would hold GPUs it never uses; set gpu.count=1 (or gpu.enabled=false for the CPU)" $v.gpu.count) }}
{{- end }}
{{- if and (eq $v.adapterStore.blobs "local") (or $v.autoscaling.enabled (gt (int $v.replicaCount) 1)) }}
{{- fail "adapterStore.blobs=local keeps adapters inside each pod, so replicas would serve different adapters: set adapterStore.blobs=s3 (with adapterStore.s3.bucket) before replicaCount > 1 or autoscaling.enabled=true" }}
{{- end }}
{{- if and (eq $v.adapterStore.blobs "s3") (eq $v.redis.mode "none") (or $v.autoscaling.enabled (gt (int $v.replicaCount) 1)) }}
{{- fail "adapterStore.blobs=s3 with redis.mode=none gives each pod its own in-memory index and change feed, so a pod would go on serving an adapter that another pod replaced or deleted: set redis.mode=external (or bundled) before replicaCount > 1 or autoscaling.enabled=true" }}
{{- end }}
{{- if and $v.autoscaling.enabled (gt (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas)) }}
{{- fail (printf "autoscaling.minReplicas (%v) is above autoscaling.maxReplicas (%v)" $v.autoscaling.minReplicas $v.autoscaling.maxReplicas) }}
{{- end }}
{{- if $v.autoscaling.enabled }}
{{- if and $v.autoscaling.cpuTargetUtilization (not (dig "requests" "cpu" "" $v.server.resources)) }}
{{- fail "autoscaling.cpuTargetUtilization needs server.resources.requests.cpu (utilization is a share of the request)" }}
{{- end }}
{{- if and (not $v.autoscaling.customMetric.enabled) (not $v.autoscaling.cpuTargetUtilization) }}
{{- fail "autoscaling.enabled=true needs a metric: autoscaling.customMetric.enabled=true or autoscaling.cpuTargetUtilization" }}
{{- end }}
{{- end }}
{{- if gt (int $v.server.defaultMaxNewTokens) (int $v.server.maxNewTokensLimit) }}
{{- fail (printf "server.defaultMaxNewTokens (%v) is above server.maxNewTokensLimit (%v)" $v.server.defaultMaxNewTokens $v.server.maxNewTokensLimit) }}
{{- end }}
{{- if eq $v.model.source "volume" }}
{{- if eq (empty $v.model.volume.claimName) (empty $v.model.volume.hostPath) }}
{{- fail "model.source=volume needs exactly one of model.volume.claimName (a PVC) and model.volume.hostPath" }}
{{- end }}
{{- else if and (eq $v.model.source "s3") (not $v.model.s3.bucket) }}
{{- fail "model.source=s3 needs model.s3.bucket (and model.s3.prefix, the model's folder or .gguf key)" }}
{{- else if and (eq $v.model.source "s3") (hasSuffix ".gguf" (lower $v.model.s3.prefix)) (ne (base $v.model.s3.prefix) $v.model.path) }}
{{- fail (printf "model.s3.prefix names one file: it is copied as %q, so set model.path=%q" (base $v.model.s3.prefix) (base $v.model.s3.prefix)) }}
{{- end }}
{{- if regexMatch "(^|/)\\.\\.(/|$)" $v.model.path }}
{{- fail "model.path must stay inside the model volume: no '..' parts" }}
{{- end }}
{{- if and (eq $v.model.source "embedded") (or $v.model.path (ne $v.model.format "auto")) }}
{{- fail "model.path and model.format apply to model.source=volume or s3; the embedded model needs neither" }}
{{- end }}
{{- if and (eq $v.adapterStore.blobs "s3") (not $v.adapterStore.s3.bucket) }}
{{- fail "adapterStore.blobs=s3 needs adapterStore.s3.bucket" }}
{{- end }}
{{- include "loraplex.validateSecrets" . }}
{{- /* The server and the sidecar share the pod's network: a port used twice fails at start ("Address already in use"). */}}
{{- $ports := list (list "server.grpcPort" $v.server.grpcPort) (list "server.metricsPort" $v.server.metricsPort) }}
{{- if $v.server.httpPort }}{{ $ports = append $ports (list "server.httpPort" $v.server.httpPort) }}{{ end }}
{{- if include "loraplex.tlsOn" . }}{{ $ports = append $ports (list "tls.healthPort" $v.tls.healthPort) }}{{ end }}
{{- $ports = append $ports (list "adapterStore.grpcPort" $v.adapterStore.grpcPort) }}
{{- if $v.adapterStore.metricsPort }}{{ $ports = append $ports (list "adapterStore.metricsPort" $v.adapterStore.metricsPort) }}{{ end }}
{{- range $i, $a := $ports }}
{{- range $j, $b := $ports }}
{{- if and (lt $i $j) (eq (int (index $a 1)) (int (index $b 1))) }}
{{- fail (printf "%s and %s are both %d: the server and the adapter-store sidecar share the pod's ports, so each must differ" (index $a 0) (index $b 0) (int (index $a 1))) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* The ports of each Service: the client one and the metrics one (the API server refuses one number twice). */}}
{{- $clientPorts := list (list "service.grpcPort" $v.service.grpcPort) }}
{{- if $v.server.httpPort }}{{ $clientPorts = append $clientPorts (list "service.httpPort" $v.service.httpPort) }}{{ end }}
{{- $metricsPorts := list (list "service.metricsPort" $v.service.metricsPort) }}
{{- if $v.adapterStore.metricsPort }}{{ $metricsPorts = append $metricsPorts (list "adapterStore.metricsPort" $v.adapterStore.metricsPort) }}{{ end }}
{{- range $servicePorts := list $clientPorts $metricsPorts }}
{{- range $i, $a := $servicePorts }}
{{- range $j, $b := $servicePorts }}
{{- if and (lt $i $j) (eq (int (index $a 1)) (int (index $b 1))) }}
{{- fail (printf "%s and %s are both %d: they are ports of one Service, so each must differ" (index $a 0) (index $b 0) (int (index $a 1))) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $fullname := include "loraplex.fullname" . }}
{{- $services := list $fullname (include "loraplex.suffixed" (list $fullname "headless")) (include "loraplex.metricsServiceName" .) }}
{{- if eq $v.redis.mode "bundled" }}
{{- $redis := include "loraplex.redisName" . }}
{{- $services = concat $services (list $redis (include "loraplex.suffixed" (list $redis "headless"))) }}
{{- end }}
{{- if ne (len $services) (len (uniq $services)) }}
{{- fail (printf "the Services of this release would share a name (%s): choose another release name or set fullnameOverride" (join ", " $services)) }}
{{- end }}
{{- if eq $v.redis.mode "external" }}
{{- $r := $v.redis.external }}
{{- if eq (empty $r.url) (empty $r.existingSecret) }}
{{- fail "redis.mode=external needs exactly one of redis.external.url and redis.external.existingSecret (a Secret holding the URL)" }}
{{- end }}
{{- if and $r.url (not (regexMatch "^(redis|rediss|unix)://" $r.url)) }}
{{- fail "redis.external.url must start with redis://, rediss:// or unix://" }}
{{- end }}
{{- /* A password as userinfo (user:pass@, :pass@) or as a query parameter (?password=, which
redis-py's from_url also reads, like any *password* key; a key with a %-escape may spell one).
A user name alone is no secret and stays allowed. */}}
{{- if and $r.url (or (regexMatch "^[a-z]+://[^/?#@]*:[^/?#]*@" $r.url) (regexMatch "(?i)[?&][^=&#]*(password|%)[^=&#]*=" $r.url)) }}
{{- fail "redis.external.url carries a password: put the whole URL in a Secret and set redis.external.existingSecret (and urlKey) instead" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Credentials are read only from Secrets. The schema refuses unknown keys; this check also
holds when schema validation is skipped. Values are never echoed, only key names.
*/}}
{{- define "loraplex.validateSecrets" -}}
{{- $allowed := dict "s3" (list "endpoint" "region" "credentials") "s3.credentials" (list "existingSecret" "accessKeyIdKey" "secretAccessKeyKey" "sessionTokenKey") "model.s3" (list "bucket" "prefix" "sizeLimit") "adapterStore.s3" (list "bucket" "prefix") }}
{{- $maps := dict "s3" .Values.s3 "s3.credentials" .Values.s3.credentials "model.s3" .Values.model.s3 "adapterStore.s3" .Values.adapterStore.s3 }}
{{- range $where, $keys := $allowed }}
{{- range $key, $_ := get $maps $where }}
{{- if not (has $key $keys) }}
{{- fail (printf "%s.%s is not a setting of this chart; S3 credentials are never values: create a Secret and set s3.credentials.existingSecret" $where $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
